//! Renderer tests of the operations surface.
