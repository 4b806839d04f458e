//! Element types and reduction operations of the collectives.

use cudarc::driver::DeviceRepr;
use half::{bf16, f16};

/// An element type the collectives support.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// `f32`
    F32,
    /// `f64`
    F64,
    /// `half::f16`
    F16,
    /// `half::bf16`
    BF16,
    /// `i32`
    I32,
    /// `i64`
    I64,
    /// `u32`
    U32,
    /// `u64`
    U64,
    /// `i8`
    I8,
    /// `u8`
    U8,
    /// `float8::F8E4M3` (OCP FP8 E4M3: no infinities, largest finite 448)
    F8E4M3,
    /// `float8::F8E5M2` (OCP FP8 E5M2: the top byte of an IEEE f16)
    F8E5M2,
}

impl DType {
    /// Every supported type.
    pub const ALL: [DType; 12] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U32,
        DType::U64,
        DType::I8,
        DType::U8,
        DType::F8E4M3,
        DType::F8E5M2,
    ];

    /// Short name, as used in kernel names and on the command line (`f32`, `bf16`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I8 | DType::U8 | DType::F8E4M3 | DType::F8E5M2 => 1,
        }
    }

    /// Whether it is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = crate::error::Error;
    fn from_str(s: &str) -> crate::error::Result<Self> {
        DType::ALL.into_iter().find(|d| d.name() == s).ok_or_else(|| crate::error::Error::InvalidArgument(format!("unknown element type {s:?}")))
    }
}

/// A reduction operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum. Integers wrap on overflow.
    Sum,
    /// Product. Integers wrap on overflow.
    Prod,
    /// Minimum. For floats, NaN in any input gives NaN (across hosts, where
    /// NCCL reduces, NCCL's rule: a NaN beside a number is ignored).
    Min,
    /// Maximum. For floats, NaN in any input gives NaN (across hosts, as
    /// [`ReduceOp::Min`]).
    Max,
    /// Mean over the ranks, for floating-point types only. Every reduction
    /// sums each rank's input divided by the number of ranks (as NCCL's
    /// pre-multiplied average does), so that a mean the type can hold never
    /// overflows in a partial sum (two ranks of 40,000 in f16, say); every
    /// rank gets the same bits, while another algorithm (another summation
    /// order) may round the last bit differently. On integer types it is refused with
    /// [`crate::error::Error::UnsupportedOp`] (integer division would silently
    /// truncate; sum and divide yourself if that is what you want).
    Avg,
}

impl ReduceOp {
    /// Every operation.
    pub const ALL: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];

    /// Short name (`sum`, `prod`, `min`, `max`, `avg`).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

    /// Checks that the operation is defined for `dtype`.
    pub fn check(self, dtype: DType) -> crate::error::Result<()> {
        if self == ReduceOp::Avg && !dtype.is_float() {
            return Err(crate::error::Error::UnsupportedOp { op: self.name(), dtype: dtype.name() });
        }
        Ok(())
    }
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ReduceOp {
    type Err = crate::error::Error;
    fn from_str(s: &str) -> crate::error::Result<Self> {
        ReduceOp::ALL.into_iter().find(|o| o.name() == s).ok_or_else(|| crate::error::Error::InvalidArgument(format!("unknown reduction {s:?}")))
    }
}

mod sealed {
    /// Only this crate's element types implement [`super::Movable`] and
    /// [`super::Element`].
    pub trait Sealed {
        /// The type's [`super::DType`] (its index in `DType::ALL` is the
        /// type's index in the call descriptors the ranks compare).
        const SEALED_DTYPE: super::DType;
    }
}

/// The name of the movable type of descriptor index `index`.
pub(crate) fn movable_name(index: u8) -> &'static str {
    DType::ALL.get(usize::from(index)).map_or("?", |d| d.name())
}

/// The descriptor index of `T` (see [`movable_name`]).
pub(crate) fn movable_index<T: Movable>() -> u8 {
    movable_dtype::<T>() as u8
}

/// `T`'s [`DType`]: every [`Movable`] is an [`Element`], but a bound of
/// `Movable` alone cannot name [`Element::DTYPE`].
pub(crate) fn movable_dtype<T: Movable>() -> DType {
    <T as sealed::Sealed>::SEALED_DTYPE
}

/// Rust element types the data-moving calls take (send, receive,
/// all-gather, all-to-all, broadcast), moved bit for bit: every
/// [`Element`].
///
/// Sealed, like [`Element`]: the sizes the calls compute are
/// `size_of::<T>()`.
pub trait Movable: sealed::Sealed + DeviceRepr + bytemuck::Pod + Send + Sync + 'static {}

/// Rust element types usable in collectives: the twelve types of [`DType`],
/// among them the fp8 types of the `float8` crate, [`float8::F8E4M3`] and
/// [`float8::F8E5M2`].
///
/// fp8 sums and products round as NCCL's (2.24 and later, on sm_90): each
/// pairwise step is computed in f32 (exact for two fp8 values), rounded to
/// f16 (to nearest even), then to fp8 (to nearest even, saturating to the
/// largest finite value: 448 for E4M3, 57344 for E5M2; NaN stays NaN); min
/// and max return one of the inputs (NaN if either is NaN), as for every
/// float type, where NCCL's ignore a NaN beside a number and saturate an
/// E5M2 infinity to ±57344. A sum of many ranks rounds at every step, in
/// the algorithm's order (see [`ReduceOp`]). [`ReduceOp::Avg`] divides each input by the rank count
/// (f32, then rounded through f16 to fp8) before the sum; NCCL multiplies
/// by a rounded reciprocal, so where the count is not a power of two the
/// last bit may differ.
///
/// The trait is sealed: every size the collectives compute comes from
/// [`Element::DTYPE`], so a type whose `DTYPE` did not match its layout
/// would make kernels write past buffers. Implementing it elsewhere does not
/// compile:
///
/// ```compile_fail
/// #[derive(Clone, Copy)]
/// #[repr(transparent)]
/// struct Wide(u64);
/// // SAFETY: a plain u64.
/// unsafe impl bytemuck::Zeroable for Wide {}
/// unsafe impl bytemuck::Pod for Wide {}
/// unsafe impl cuda_peer::cudarc::driver::DeviceRepr for Wide {}
/// impl cuda_peer::Element for Wide {
///     const DTYPE: cuda_peer::DType = cuda_peer::DType::U8;
/// }
/// ```
///
/// (The same type without the `Element` impl compiles:)
///
/// ```
/// #[derive(Clone, Copy)]
/// #[repr(transparent)]
/// struct Wide(u64);
/// // SAFETY: a plain u64.
/// unsafe impl bytemuck::Zeroable for Wide {}
/// unsafe impl bytemuck::Pod for Wide {}
/// unsafe impl cuda_peer::cudarc::driver::DeviceRepr for Wide {}
/// ```
pub trait Element: Movable {
    /// The matching [`DType`].
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {
            const SEALED_DTYPE: DType = DType::$d;
        }
        impl Movable for $t {}
        impl Element for $t { const DTYPE: DType = DType::$d; }
    )*};
}
element!(
    f32 => F32,
    f64 => F64,
    f16 => F16,
    bf16 => BF16,
    i32 => I32,
    i64 => I64,
    u32 => U32,
    u64 => U64,
    i8 => I8,
    u8 => U8,
    float8::F8E4M3 => F8E4M3,
    float8::F8E5M2 => F8E5M2,
);

/// Runs `$body` with the type alias `$T` naming the [`Element`] of the
/// [`DType`] `$dtype`: the generic collectives on a type known only at run
/// time (the raw-pointer calls).
macro_rules! with_element {
    ($dtype:expr, $T:ident => $body:expr) => {{
        use $crate::dtype::DType;
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::F16 => {
                type $T = half::f16;
                $body
            }
            DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            DType::I32 => {
                type $T = i32;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
            DType::U32 => {
                type $T = u32;
                $body
            }
            DType::U64 => {
                type $T = u64;
                $body
            }
            DType::I8 => {
                type $T = i8;
                $body
            }
            DType::U8 => {
                type $T = u8;
                $body
            }
            DType::F8E4M3 => {
                type $T = float8::F8E4M3;
                $body
            }
            DType::F8E5M2 => {
                type $T = float8::F8E5M2;
                $body
            }
        }
    }};
}
pub(crate) use with_element;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_element_names_each_dtypes_type() {
        for d in DType::ALL {
            assert_eq!(with_element!(d, T => T::DTYPE), d);
        }
    }

    #[test]
    fn movable_indices_name_their_types() {
        fn check<T: Movable>(name: &str) {
            assert_eq!(movable_name(movable_index::<T>()), name);
        }
        for (i, d) in DType::ALL.iter().enumerate() {
            assert_eq!(*d as usize, i);
        }
        check::<f32>("f32");
        check::<bf16>("bf16");
        check::<u8>("u8");
        check::<float8::F8E4M3>("f8e4m3");
        check::<float8::F8E5M2>("f8e5m2");
        assert_eq!(movable_name(200), "?");
    }

    #[test]
    fn names_round_trip_and_match_sizes() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        for o in ReduceOp::ALL {
            assert_eq!(o.name().parse::<ReduceOp>().unwrap(), o);
        }
        assert_eq!(<half::bf16 as Element>::DTYPE.size(), std::mem::size_of::<half::bf16>());
        assert_eq!(<u64 as Element>::DTYPE.size(), 8);
        fn layout_matches<T: Element>() {
            assert_eq!(T::DTYPE.size(), std::mem::size_of::<T>(), "{}", T::DTYPE);
            assert_eq!(std::mem::align_of::<T>(), std::mem::size_of::<T>(), "{}", T::DTYPE);
        }
        layout_matches::<f32>();
        layout_matches::<f64>();
        layout_matches::<f16>();
        layout_matches::<bf16>();
        layout_matches::<i32>();
        layout_matches::<i64>();
        layout_matches::<u32>();
        layout_matches::<u64>();
        layout_matches::<i8>();
        layout_matches::<u8>();
        layout_matches::<float8::F8E4M3>();
        layout_matches::<float8::F8E5M2>();
        assert!("f8".parse::<DType>().is_err());
    }

    #[test]
    fn avg_is_refused_on_integers_only() {
        for d in DType::ALL {
            assert_eq!(ReduceOp::Avg.check(d).is_ok(), d.is_float(), "{d}");
            assert!(ReduceOp::Sum.check(d).is_ok());
        }
    }
}
