//! [`NDList`]: an ordered list of arrays moved together.

use crate::arena::Owner;
use crate::error::Ctx;
use crate::state::{self, Move};
use crate::{Manager, NDArray, Result};

/// An ordered list of arrays (DJL's `NDList`): `attach`, `temp_attach`, `detach` apply to every
/// array, all or nothing; `close` closes each.
///
/// ```
/// use ndscope::{DType, Manager, NDList};
/// let m = Manager::new_base();
/// let list: NDList = vec![m.zeros([2], DType::F32)?, m.ones([3], DType::F32)?].into();
/// let other = Manager::new_base();
/// list.attach(&other)?;
/// m.close()?;                            // the arrays now belong to `other`
/// assert!(list.iter().all(|a| a.is_open()));
/// # Ok::<(), ndscope::Error>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NDList(Vec<NDArray>);

impl NDList {
    /// An empty list.
    pub fn new() -> NDList {
        NDList(Vec::new())
    }

    /// Appends an array.
    pub fn push(&mut self, array: NDArray) {
        self.0.push(array);
    }

    /// The number of arrays.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The array at `index`, if any.
    pub fn get(&self, index: usize) -> Option<&NDArray> {
        self.0.get(index)
    }

    /// The arrays in order.
    pub fn iter(&self) -> std::slice::Iter<'_, NDArray> {
        self.0.iter()
    }

    /// The arrays as a slice.
    pub fn as_slice(&self) -> &[NDArray] {
        &self.0
    }

    /// The arrays, consuming the list.
    pub fn into_vec(self) -> Vec<NDArray> {
        self.0
    }

    /// [`NDArray::attach`] for every array, all or nothing.
    #[track_caller]
    pub fn attach(&self, manager: &Manager) -> Result<()> {
        manager.attach_all(&self.0)
    }

    /// [`NDArray::temp_attach`] for every array, all or nothing.
    #[track_caller]
    pub fn temp_attach(&self, manager: &Manager) -> Result<()> {
        manager.temp_attach_all(&self.0)
    }

    /// [`NDArray::detach`] for every array, all or nothing.
    #[track_caller]
    pub fn detach(&self) -> Result<()> {
        let ctx = Ctx::new("NDList::detach");
        let inners: Vec<_> = self.0.iter().map(|a| &*a.0).collect();
        state::lock().move_arrays(&ctx, &inners, Owner::Detached, None, Move::Detach)
    }

    /// Closes every array (idempotent).
    #[track_caller]
    pub fn close(&self) -> Result<()> {
        for array in &self.0 {
            array.close()?;
        }
        Ok(())
    }
}

impl From<Vec<NDArray>> for NDList {
    fn from(arrays: Vec<NDArray>) -> Self {
        NDList(arrays)
    }
}

impl FromIterator<NDArray> for NDList {
    fn from_iter<I: IntoIterator<Item = NDArray>>(iter: I) -> Self {
        NDList(iter.into_iter().collect())
    }
}

impl<'a> IntoIterator for &'a NDList {
    type Item = &'a NDArray;
    type IntoIter = std::slice::Iter<'a, NDArray>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl IntoIterator for NDList {
    type Item = NDArray;
    type IntoIter = std::vec::IntoIter<NDArray>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl Manager {
    /// [`ret`](Self::ret) for every array of the list, all or nothing.
    #[track_caller]
    pub fn ret_list(&self, list: &NDList) -> Result<NDList> {
        let ctx = Ctx::new("Manager::ret_list");
        let arrays: Vec<&NDArray> = list.iter().collect();
        self.ret_inner(&ctx, &arrays)?;
        Ok(list.clone())
    }
}
