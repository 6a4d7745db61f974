//! [`HostArray`]: an array's elements owned by the caller, outside every manager.
//!
//! It is what leaves a predictor's context (DJL's `Translator` boundary): an [`NDArray`](crate::NDArray) is a
//! handle into a manager and dies with its scope, a `HostArray` is plain data (a `Vec` and a
//! shape) that lives as long as the caller keeps it, on any thread.

use std::any::Any;
use std::fmt;

use crate::error::Ctx;
use crate::{DType, Element, Result, Shape};

/// Row-major elements and a shape, owned by the caller: no manager, no workspace, no handle
/// that can be closed under it. Requests to and answers from a
/// [`ParallelInference`](crate::ParallelInference) are `HostArray`s.
///
/// It is not the host storage of an [`NDArray`](crate::NDArray) (that lives inside a manager and is reached only
/// through the array's handle): [`Manager::from_host`](crate::Manager::from_host) copies a `HostArray` into an array, and
/// [`NDArray::to_host`](crate::NDArray::to_host) copies an array out into a new one.
///
/// ```
/// use ndscope::{HostArray, Manager};
/// let x = HostArray::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2])?;
/// let m = Manager::new_base();
/// let y = m.from_host(&x)?.mul_scalar(10.0)?.to_host()?;   // into a manager and back out
/// m.close()?;                                            // y does not depend on `m`
/// assert_eq!(y.as_slice::<f32>()?, &[10.0, 20.0, 30.0, 40.0]);
/// assert_eq!(y.dims(), &[2, 2]);
/// # Ok::<(), ndscope::Error>(())
/// ```
#[derive(Clone, PartialEq)]
pub struct HostArray {
    pub(crate) shape: Shape,
    pub(crate) data: HostData,
}

/// The elements of a [`HostArray`], by dtype.
#[derive(Clone, PartialEq)]
pub(crate) enum HostData {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    U8(Vec<u8>),
    F16(Vec<half::f16>),
    BF16(Vec<half::bf16>),
}

impl HostData {
    /// Takes `data` as the variant of its element type.
    fn from_vec<T: Element>(data: Vec<T>) -> HostData {
        // `Element` is sealed to these seven types, so exactly one cast succeeds.
        let data = match cast_vec::<T, f32>(data) {
            Ok(v) => return HostData::F32(v),
            Err(d) => d,
        };
        let data = match cast_vec::<T, f64>(data) {
            Ok(v) => return HostData::F64(v),
            Err(d) => d,
        };
        let data = match cast_vec::<T, i32>(data) {
            Ok(v) => return HostData::I32(v),
            Err(d) => d,
        };
        let data = match cast_vec::<T, i64>(data) {
            Ok(v) => return HostData::I64(v),
            Err(d) => d,
        };
        let data = match cast_vec::<T, u8>(data) {
            Ok(v) => return HostData::U8(v),
            Err(d) => d,
        };
        let data = match cast_vec::<T, half::f16>(data) {
            Ok(v) => return HostData::F16(v),
            Err(d) => d,
        };
        match cast_vec::<T, half::bf16>(data) {
            Ok(v) => HostData::BF16(v),
            Err(_) => {
                unreachable!("Element is implemented for f32, f64, i32, i64, u8, f16, bf16 only")
            }
        }
    }

    fn dtype(&self) -> DType {
        match self {
            HostData::F32(_) => DType::F32,
            HostData::F64(_) => DType::F64,
            HostData::I32(_) => DType::I32,
            HostData::I64(_) => DType::I64,
            HostData::U8(_) => DType::U8,
            HostData::F16(_) => DType::F16,
            HostData::BF16(_) => DType::BF16,
        }
    }

    fn as_any(&self) -> &dyn Any {
        match self {
            HostData::F32(v) => v,
            HostData::F64(v) => v,
            HostData::I32(v) => v,
            HostData::I64(v) => v,
            HostData::U8(v) => v,
            HostData::F16(v) => v,
            HostData::BF16(v) => v,
        }
    }
}

/// `v` as a `Vec<T>` when `S` is `T` (no copy), else `v` back.
fn cast_vec<S: 'static, T: 'static>(v: Vec<S>) -> Result<Vec<T>, Vec<S>> {
    let mut slot = Some(v);
    match (&mut slot as &mut dyn Any).downcast_mut::<Option<Vec<T>>>() {
        Some(t) => Ok(t.take().unwrap_or_default()),
        None => Err(slot.unwrap_or_default()),
    }
}

impl fmt::Debug for HostArray {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostArray({} {})", self.dtype(), self.shape)
    }
}

impl HostArray {
    /// Takes `data` (row-major) as an array of `shape`. `ShapeMismatch` when the lengths differ,
    /// `InvalidArgument` for a shape too large to address.
    #[track_caller]
    pub fn from_vec<T: Element>(data: Vec<T>, shape: impl Into<Shape>) -> Result<HostArray> {
        let ctx = Ctx::new("HostArray::from_vec");
        let shape = shape.into();
        crate::shape::check(&ctx, &shape, T::DTYPE)?;
        if data.len() != shape.size() {
            return Err(ctx.shape(format!(
                "{} elements given for shape {shape} ({} elements)",
                data.len(),
                shape.size()
            )));
        }
        Ok(HostArray {
            shape,
            data: HostData::from_vec(data),
        })
    }

    /// Copies `data` into a new array of `shape` (see [`from_vec`](Self::from_vec)).
    #[track_caller]
    pub fn from_slice<T: Element>(data: &[T], shape: impl Into<Shape>) -> Result<HostArray> {
        HostArray::from_vec(data.to_vec(), shape)
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// The number of elements.
    pub fn size(&self) -> usize {
        self.shape.size()
    }

    /// Bytes of data.
    pub fn nbytes(&self) -> usize {
        self.size() * self.dtype().size_in_bytes()
    }

    /// The elements, row-major. `DTypeMismatch` unless `T` is the dtype.
    #[track_caller]
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        let ctx = Ctx::new("HostArray::as_slice");
        self.data
            .as_any()
            .downcast_ref::<Vec<T>>()
            .map(Vec::as_slice)
            .ok_or_else(|| self.dtype_error(&ctx, T::DTYPE))
    }

    /// The elements, row-major, consuming the array. `DTypeMismatch` unless `T` is the dtype.
    #[track_caller]
    pub fn into_vec<T: Element>(self) -> Result<Vec<T>> {
        let ctx = Ctx::new("HostArray::into_vec");
        if T::DTYPE != self.dtype() {
            return Err(self.dtype_error(&ctx, T::DTYPE));
        }
        let taken = match self.data {
            HostData::F32(v) => cast_vec(v).ok(),
            HostData::F64(v) => cast_vec(v).ok(),
            HostData::I32(v) => cast_vec(v).ok(),
            HostData::I64(v) => cast_vec(v).ok(),
            HostData::U8(v) => cast_vec(v).ok(),
            HostData::F16(v) => cast_vec(v).ok(),
            HostData::BF16(v) => cast_vec(v).ok(),
        };
        taken.ok_or_else(|| ctx.dtype(T::DTYPE, "internal: element type and storage disagree"))
    }

    fn dtype_error(&self, ctx: &Ctx, wanted: DType) -> crate::Error {
        ctx.dtype(
            self.dtype(),
            format!(
                "host array {self:?} holds {}, asked for {wanted}",
                self.dtype()
            ),
        )
    }

    /// The arrays one after another along axis 0 (as ND4J's `ParallelInference` batches
    /// requests): every part has the same dtype and the same dimensions after the first
    /// (`DTypeMismatch`, `ShapeMismatch`); `InvalidArgument` for no parts or 0-d parts.
    ///
    /// ```
    /// use ndscope::HostArray;
    /// let a = HostArray::from_vec(vec![1i64, 2], [1, 2])?;
    /// let b = HostArray::from_vec(vec![3i64, 4, 5, 6], [2, 2])?;
    /// let ab = HostArray::concat_rows(&[a, b])?;
    /// assert_eq!(ab.dims(), &[3, 2]);
    /// assert_eq!(ab.split_rows(&[1, 2])?[1].as_slice::<i64>()?, &[3, 4, 5, 6]);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn concat_rows(parts: &[HostArray]) -> Result<HostArray> {
        let ctx = Ctx::new("HostArray::concat_rows");
        let Some(first) = parts.first() else {
            return Err(ctx.invalid("no arrays to concatenate"));
        };
        if first.dims().is_empty() {
            return Err(ctx.invalid("0-d arrays have no rows to concatenate"));
        }
        let tail = &first.dims()[1..];
        let mut rows = 0usize;
        for (i, part) in parts.iter().enumerate() {
            if part.dtype() != first.dtype() {
                return Err(ctx.dtype(
                    part.dtype(),
                    format!("part {i} is {}, part 0 is {}", part.dtype(), first.dtype()),
                ));
            }
            if part.dims().is_empty() || &part.dims()[1..] != tail {
                return Err(ctx.shape(format!(
                    "part {i} has shape {}, part 0 has {}: all but the first dimension must agree",
                    part.shape(),
                    first.shape()
                )));
            }
            rows += part.dims()[0];
        }
        let mut dims = vec![rows];
        dims.extend_from_slice(tail);
        let shape = Shape::from(dims);
        crate::shape::check(&ctx, &shape, first.dtype())?;
        macro_rules! join {
            ($variant:ident) => {{
                let mut out = Vec::with_capacity(shape.size());
                for part in parts {
                    if let HostData::$variant(v) = &part.data {
                        out.extend_from_slice(v);
                    }
                }
                HostData::$variant(out)
            }};
        }
        let data = match first.data {
            HostData::F32(_) => join!(F32),
            HostData::F64(_) => join!(F64),
            HostData::I32(_) => join!(I32),
            HostData::I64(_) => join!(I64),
            HostData::U8(_) => join!(U8),
            HostData::F16(_) => join!(F16),
            HostData::BF16(_) => join!(BF16),
        };
        Ok(HostArray { shape, data })
    }

    /// Cuts the array along axis 0 into parts of `rows[0]`, `rows[1]`, … rows, which must add up
    /// to the first dimension (`ShapeMismatch`; `InvalidArgument` for a 0-d array).
    #[track_caller]
    pub fn split_rows(&self, rows: &[usize]) -> Result<Vec<HostArray>> {
        let ctx = Ctx::new("HostArray::split_rows");
        let Some((&total, tail)) = self.dims().split_first() else {
            return Err(ctx.invalid("a 0-d array has no rows to split"));
        };
        let sum = rows.iter().try_fold(0usize, |a, &r| a.checked_add(r));
        if sum != Some(total) {
            return Err(ctx.shape(format!(
                "parts of {rows:?} rows do not add up to the {total} rows of shape {}",
                self.shape()
            )));
        }
        let per_row: usize = tail.iter().product();
        let mut start = 0;
        let mut parts = Vec::with_capacity(rows.len());
        for &r in rows {
            let range = start * per_row..(start + r) * per_row;
            start += r;
            let mut dims = vec![r];
            dims.extend_from_slice(tail);
            let data = match &self.data {
                HostData::F32(v) => HostData::F32(v[range].to_vec()),
                HostData::F64(v) => HostData::F64(v[range].to_vec()),
                HostData::I32(v) => HostData::I32(v[range].to_vec()),
                HostData::I64(v) => HostData::I64(v[range].to_vec()),
                HostData::U8(v) => HostData::U8(v[range].to_vec()),
                HostData::F16(v) => HostData::F16(v[range].to_vec()),
                HostData::BF16(v) => HostData::BF16(v[range].to_vec()),
            };
            parts.push(HostArray {
                shape: Shape::from(dims),
                data,
            });
        }
        Ok(parts)
    }
}
