//! [`Transpose`]: which operands of a matrix product are read transposed (a leaf type, used
//! by the matrix ops and by the gradients that keep products pending).

/// Which operands of a 2-D matrix product are read transposed (ND4J's `MMulTranspose`; in
/// PyTorch, `a.T @ b`). The transposed operand is read in place, through strides: no copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Transpose {
    /// `a · b`.
    #[default]
    None,
    /// `aᵀ · b`.
    Left,
    /// `a · bᵀ`.
    Right,
    /// `aᵀ · bᵀ`.
    Both,
}

impl Transpose {
    /// Whether the left and the right operand are read transposed.
    pub(crate) fn flags(self) -> (bool, bool) {
        match self {
            Transpose::None => (false, false),
            Transpose::Left => (true, false),
            Transpose::Right => (false, true),
            Transpose::Both => (true, true),
        }
    }

    /// The variant reading the left operand transposed when `left`, the right when `right`.
    pub(crate) fn from_flags(left: bool, right: bool) -> Transpose {
        match (left, right) {
            (false, false) => Transpose::None,
            (true, false) => Transpose::Left,
            (false, true) => Transpose::Right,
            (true, true) => Transpose::Both,
        }
    }
}
