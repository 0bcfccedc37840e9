//! The service stubs' codec: tonic's prost codec, except that the encoder reserves a message's
//! whole encoded length before writing it.
//!
//! tonic encodes a stream's messages into one buffer. prost writes fields in tag order, and
//! `contract_marker` (field 127) follows `FilterUpdate.payload`; without the reservation the
//! marker's five bytes after a 4 MiB snapshot chunk doubled that buffer to 8 MiB, and the
//! stream's next messages filled the unused half while the whole allocation stayed alive. With
//! it, a message grows the buffer once, to its exact size, and the allocation goes with the
//! message's last frame.

use std::marker::PhantomData;

use prost::Message;
use tonic::Status;
use tonic::codec::{Codec, EncodeBuf, Encoder};
use tonic_prost::ProstDecoder;

/// [`tonic_prost::ProstCodec`] with [`ExactEncoder`].
#[derive(Debug, Clone)]
pub struct ExactCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for ExactCodec<T, U> {
    fn default() -> Self {
        ExactCodec(PhantomData)
    }
}

impl<T, U> Codec for ExactCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ExactEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> ExactEncoder<T> {
        ExactEncoder(PhantomData)
    }

    fn decoder(&mut self) -> ProstDecoder<U> {
        ProstDecoder::default()
    }
}

/// Encodes a message after reserving its encoded length in the stream's buffer.
#[derive(Debug, Clone)]
pub struct ExactEncoder<T>(PhantomData<T>);

impl<T: Message> Encoder for ExactEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.reserve(item.encoded_len());
        item.encode(buf).map_err(|error| Status::internal(format!("encoding a message: {error}")))
    }
}
