//! A software prefetch of one element of a slice.
//!
//! The relay applies a store's blocks together: it computes where each block's filter bucket
//! lives, asks the CPU to start loading every one of those cache lines, and only then writes the
//! blocks one by one, so that the cache misses of a batch overlap instead of following one
//! another. A plain load used as a prefetch does overlap its misses too, but it must retire
//! before the instructions after it can, so a batch of them fills the CPU's reorder window and
//! stalls it; a prefetch instruction retires at once.
//!
//! A prefetch is a hint: it reads nothing into the program, never faults (not even on an
//! unmapped address) and changes no memory. The only `unsafe` is the intrinsic's declaration,
//! and [`prefetch`] takes a slice and an index it checks, so callers need none. On targets
//! without a stable prefetch intrinsic it is a plain load, the warming the relay used before.

/// Ask the CPU to bring the cache line holding `slice[index]` into every cache level; does
/// nothing when `index` is out of bounds. Changes no memory and, on x86_64, returns before the
/// line arrives (elsewhere it is a plain load the optimizer must keep).
#[inline(always)]
pub fn prefetch<T: Copy>(slice: &[T], index: usize) {
    let Some(element) = slice.get(index) else { return };
    prefetch_line(element);
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_line<T: Copy>(element: &T) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    let address: *const i8 = std::ptr::from_ref(element).cast();
    // SAFETY: `_mm_prefetch` is declared unsafe only because it is a `target_feature(sse)`
    // intrinsic, and SSE is part of the x86_64 baseline every Rust x86_64 target enables. The
    // instruction is a hint: it reads nothing into the program, never faults whatever the
    // address, and writes no memory; `address` points into a live slice besides.
    #[allow(unsafe_code)]
    unsafe {
        _mm_prefetch::<_MM_HINT_T0>(address);
    }
}

/// Without a stable prefetch intrinsic: a load whose value the optimizer must keep, which still
/// overlaps its miss with those of the loads beside it.
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn prefetch_line<T: Copy>(element: &T) {
    std::hint::black_box(*element);
}

#[cfg(test)]
mod tests {
    use super::prefetch;

    #[test]
    fn a_prefetch_changes_nothing_and_ignores_indices_out_of_bounds() {
        let words: Vec<u64> = (0..1024).collect();
        for index in [0, 1, 511, 1023, 1024, usize::MAX] {
            prefetch(&words, index);
        }
        prefetch::<u64>(&[], 0);
        assert!(words.iter().enumerate().all(|(index, &word)| word == index as u64));
    }
}
