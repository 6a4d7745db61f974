//! Array shapes.

use std::fmt;

/// Dimensions held inline; larger shapes go to the heap.
const INLINE: usize = 6;

/// The dimensions of an array, row-major. `()` or `[]` is a scalar (size 1).
///
/// Shapes of up to six dimensions are stored inline, so creating an array allocates nothing for
/// its shape.
///
/// ```
/// use ndscope::Shape;
/// let s: Shape = [2, 3].into();
/// assert_eq!(s.dims(), &[2, 3]);
/// assert_eq!(s.size(), 6);
/// assert_eq!(Shape::from(()).size(), 1);
/// assert_eq!(s.to_string(), "[2, 3]");
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Shape(Repr);

#[derive(Clone, PartialEq, Eq, Hash)]
enum Repr {
    Inline { len: u8, dims: [usize; INLINE] },
    Heap(Box<[usize]>),
}

impl Shape {
    /// A shape with these dimensions.
    pub fn new(dims: &[usize]) -> Shape {
        if dims.len() <= INLINE {
            let mut inline = [0; INLINE];
            inline[..dims.len()].copy_from_slice(dims);
            Shape(Repr::Inline {
                len: dims.len() as u8,
                dims: inline,
            })
        } else {
            Shape(Repr::Heap(dims.into()))
        }
    }

    /// The scalar shape `[]`.
    pub fn scalar() -> Shape {
        Shape::new(&[])
    }

    /// The dimensions.
    #[inline]
    pub fn dims(&self) -> &[usize] {
        match &self.0 {
            Repr::Inline { len, dims } => &dims[..*len as usize],
            Repr::Heap(dims) => dims,
        }
    }

    /// The number of dimensions.
    #[inline]
    pub fn ndim(&self) -> usize {
        self.dims().len()
    }

    /// The number of elements (1 for a scalar). Saturates at `usize::MAX`; array creation rejects
    /// shapes whose size or byte count overflows.
    #[inline]
    pub fn size(&self) -> usize {
        self.checked_size().unwrap_or(usize::MAX)
    }

    /// The number of elements, or `None` if it overflows `usize`. A shape with a zero dimension
    /// holds 0 elements, whatever its other dimensions and their order.
    pub fn checked_size(&self) -> Option<usize> {
        let (nonzero, empty) = self.nonzero_product(1);
        if empty {
            Some(0)
        } else {
            nonzero
        }
    }

    /// `start` times the product of the non-zero dimensions (`None` if it overflows), and
    /// whether a dimension is zero: one pass that every array creation makes.
    #[inline]
    fn nonzero_product(&self, start: usize) -> (Option<usize>, bool) {
        let mut product = Some(start);
        let mut empty = false;
        for &d in self.dims() {
            if d == 0 {
                empty = true;
            } else {
                product = product.and_then(|p| p.checked_mul(d));
            }
        }
        (product, empty)
    }

    /// Row-major strides in elements.
    pub fn strides(&self) -> Vec<usize> {
        contiguous_strides(self.dims())
    }

    /// Bytes of an array of this shape with elements of `elem` bytes, if such an array can be
    /// addressed: the product of the non-zero dimensions, times `elem`, must not pass
    /// `isize::MAX`. Then no product of any of its dimensions (what every op computes: rows,
    /// strides, byte offsets) can overflow, whatever their order, empty arrays included.
    pub(crate) fn addressable_bytes(&self, elem: usize) -> Option<usize> {
        match self.nonzero_product(elem) {
            (Some(bytes), empty) if bytes <= isize::MAX as usize => {
                Some(if empty { 0 } else { bytes })
            }
            _ => None,
        }
    }
}

/// The bytes of an array of `shape` and `dtype`, or `InvalidArgument` if it cannot be addressed
/// (see [`Shape::addressable_bytes`]). Every array is created through this check, so op
/// front-ends can compute products of an input's dimensions without overflow.
#[inline]
pub(crate) fn check(
    ctx: &crate::error::Ctx,
    shape: &Shape,
    dtype: crate::DType,
) -> crate::Result<usize> {
    shape
        .addressable_bytes(dtype.size_in_bytes())
        .ok_or_else(|| {
            ctx.invalid(format!(
                "an array of shape {shape} and dtype {dtype} cannot be addressed: the product of \
                 its non-zero dimensions, in bytes, passes isize::MAX"
            ))
        })
}

impl Default for Shape {
    fn default() -> Self {
        Shape::scalar()
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.dims().iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    #[inline]
    fn from(dims: [usize; N]) -> Self {
        if N <= INLINE {
            // A copy of a known length: no call to copy a slice of unknown length.
            let mut inline = [0; INLINE];
            for (slot, d) in inline.iter_mut().zip(dims) {
                *slot = d;
            }
            Shape(Repr::Inline {
                len: N as u8,
                dims: inline,
            })
        } else {
            Shape::new(&dims)
        }
    }
}

impl<const N: usize> From<&[usize; N]> for Shape {
    fn from(dims: &[usize; N]) -> Self {
        Shape::new(dims)
    }
}

impl From<&[usize]> for Shape {
    fn from(dims: &[usize]) -> Self {
        Shape::new(dims)
    }
}

impl From<Vec<usize>> for Shape {
    fn from(dims: Vec<usize>) -> Self {
        Shape::new(&dims)
    }
}

impl From<&Vec<usize>> for Shape {
    fn from(dims: &Vec<usize>) -> Self {
        Shape::new(dims)
    }
}

impl From<()> for Shape {
    fn from(_: ()) -> Self {
        Shape::scalar()
    }
}

impl From<&Shape> for Shape {
    fn from(shape: &Shape) -> Self {
        shape.clone()
    }
}

impl From<usize> for Shape {
    fn from(len: usize) -> Self {
        Shape::new(&[len])
    }
}

/// Row-major strides in elements of an array of `dims`.
pub(crate) fn contiguous_strides(dims: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1];
    }
    strides
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_and_heap_shapes_agree() {
        let small = Shape::new(&[1, 2, 3]);
        assert_eq!(small.dims(), &[1, 2, 3]);
        let big = Shape::new(&[1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(big.dims(), &[1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(big.size(), 5040);
        assert_eq!(big.strides()[0], 5040);
    }

    #[test]
    fn addressable_shapes_do_not_depend_on_dim_order() {
        let max = usize::MAX;
        assert_eq!(Shape::new(&[0, max, 2]).addressable_bytes(1), None);
        assert_eq!(Shape::new(&[2, max, 0]).addressable_bytes(1), None);
        assert_eq!(Shape::new(&[0, 1 << 62]).addressable_bytes(4), None);
        assert_eq!(Shape::new(&[0, 1 << 40]).addressable_bytes(4), Some(0));
        assert_eq!(Shape::new(&[3, 4]).addressable_bytes(8), Some(96));
        assert_eq!(Shape::scalar().addressable_bytes(8), Some(8));
    }

    #[test]
    fn size_overflow_is_detected() {
        let s = Shape::new(&[usize::MAX, 2]);
        assert_eq!(s.checked_size(), None);
        assert_eq!(Shape::new(&[3, 0, 4]).size(), 0);
        // Empty whatever the order: no overflow before the zero is reached.
        assert_eq!(Shape::new(&[2, usize::MAX, 0]).checked_size(), Some(0));
        assert_eq!(Shape::new(&[0, usize::MAX, 2]).checked_size(), Some(0));
    }
}
