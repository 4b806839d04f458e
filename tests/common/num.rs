//! Element types as numbers, for CPU references of small exact values.
#![allow(dead_code)]

use cuda_peer::Element;
use half::{bf16, f16};

/// An element type that holds small integers exactly (every cuda-peer type
/// does up to 127), converted through `f64` for CPU references.
pub trait Num: Element + Copy + std::fmt::Debug + PartialEq {
    /// `x` in this type (rounded as `as` or `half` round).
    fn from_f64(x: f64) -> Self;
    /// This value as `f64`.
    fn to_f64(self) -> f64;
}

macro_rules! num {
    ($($t:ty),*) => {$(impl Num for $t {
        fn from_f64(x: f64) -> Self { x as $t }
        fn to_f64(self) -> f64 { self as f64 }
    })*};
}
num!(f32, f64, i32, i64, u32, u64, i8, u8);

impl Num for f16 {
    fn from_f64(x: f64) -> Self {
        f16::from_f64(x)
    }
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
}

impl Num for bf16 {
    fn from_f64(x: f64) -> Self {
        bf16::from_f64(x)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
}
