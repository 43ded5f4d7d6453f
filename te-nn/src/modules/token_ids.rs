//! Token ids on the device, for [`super::Embedding`] and the cross-entropy targets: `i32`
//! values of a shape (`[s, b]`, `[tokens]`), since [`te_runtime::Tensor`] holds floating-point data
//! only.

use cudarc::driver::CudaSlice;
use std::sync::Arc;
use te_runtime::graph::HostCopies;
use te_runtime::ops::embedding::EmbeddingGradIndex;
use te_runtime::{Device, Error, Result};

/// `i32` token ids with their shape, on the device (shared: cloning is cheap, contexts keep
/// them for backward) and on the host (ids are small; the model counts targets and builds
/// position ids from the host copy without a device round trip); optionally with their grouping
/// by id for an embedding's backward ([`TokenIds::with_grad_index`], else the embedding's
/// forward builds it).
#[derive(Debug, Clone)]
pub struct TokenIds {
    host: Arc<[i32]>,
    data: Arc<CudaSlice<i32>>,
    shape: Vec<usize>,
    grad_index: Option<Arc<EmbeddingGradIndex>>,
}

impl TokenIds {
    /// Uploads `ids` (row-major in `shape`).
    ///
    /// # Errors
    /// [`Error::Shape`] when `ids.len()` is not the product of `shape` or is 0; allocation and
    /// copy failures.
    pub fn from_host(dev: &Device, shape: &[usize], ids: &[i32]) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n != ids.len() || n == 0 {
            return Err(Error::Shape {
                op: "TokenIds::from_host",
                message: format!("{} ids do not fill the non-empty shape {shape:?}", ids.len()),
            });
        }
        let data = dev.stream().htod(ids)?;
        Ok(Self { host: ids.into(), data: Arc::new(data), shape: shape.to_vec(), grad_index: None })
    }

    /// These ids with their grouping by id uploaded now ([`EmbeddingGradIndex`], what an
    /// [`super::Embedding`]'s backward reads): a forward + backward captured in a CUDA graph
    /// then makes no host upload, and [`TokenIds::update`] refreshes the grouping with the ids.
    ///
    /// # Errors
    /// Allocation and copy failures.
    pub fn with_grad_index(mut self, dev: &Device) -> Result<Self> {
        self.grad_index = Some(Arc::new(EmbeddingGradIndex::from_host(dev, &self.host)?));
        Ok(self)
    }

    /// The grouping of the ids by id, when built ([`TokenIds::with_grad_index`]).
    pub fn grad_index(&self) -> Option<&Arc<EmbeddingGradIndex>> {
        self.grad_index.as_ref()
    }

    /// Overwrites the ids in place (the device buffer keeps its address: a CUDA graph's static
    /// input, refilled before each replay), and their grouping by id when built. A host upload:
    /// not inside a graph capture.
    ///
    /// # Errors
    /// [`Error::Shape`] for another number of ids; [`Error::Argument`] while a context (or a
    /// clone) shares the buffer; [`Error::Capture`] inside a capture; copy failures.
    pub fn update(&mut self, dev: &Device, ids: &[i32]) -> Result<()> {
        if ids.len() != self.host.len() {
            return Err(Error::Shape {
                op: "TokenIds::update",
                message: format!("{} ids for a buffer of {:?}", ids.len(), self.shape),
            });
        }
        let stream = dev.stream();
        te_runtime::graph::refuse_in_capture(stream, "TokenIds::update")?;
        let shared = || Error::Argument {
            op: "TokenIds::update",
            message: "the ids are shared (a context or clone holds them): update a buffer of its own".into(),
        };
        if Arc::strong_count(&self.data) > 1 || self.grad_index.as_ref().is_some_and(|i| Arc::strong_count(i) > 1) {
            return Err(shared());
        }
        if let Some(index) = self.grad_index.as_mut().and_then(Arc::get_mut) {
            index.update(dev, ids)?;
        }
        let data = Arc::get_mut(&mut self.data).ok_or_else(shared)?;
        stream.memcpy_htod(ids, data)?;
        self.host = ids.into();
        Ok(())
    }

    /// The shape (`[s, b]`, `[tokens]`, ...).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of ids.
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// Always false: a `TokenIds` holds at least one id.
    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// The ids on the host, row-major.
    pub fn host(&self) -> &[i32] {
        &self.host
    }

    /// The ids on the device.
    pub fn data(&self) -> &CudaSlice<i32> {
        &self.data
    }
}
