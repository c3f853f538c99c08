"""How weight matrices are laid out in memory, and the one place that changes it.

jaxspec's params hold a projection as ``w [K, N]`` (``[in, out]``). On CPU the small-T kernel
is faster over the same weights laid out in panels (``Panels``: 16 output columns contiguous
along K, ``jaxspec/kernels/cpu_panels.cc``, ``docs/cpu_kernel.md``): one weight load feeds every
row of a verify window from registers, and each thread streams whole panels.

``Panels`` is a pytree (one leaf, the panel array) that ``models.linear`` takes wherever it takes
a ``[K, N]`` matrix, on every backend, with gradients, so a params tree holding it runs,
differentiates and updates (optax) like one holding plain arrays; its gradients come back in
the same layout. ``for_kernel(params)`` lays out a decoder's params for the CPU kernel (the
projection matrices of every layer and the output head: a tied embedding table is stored
transposed, ``Panels.transposed``, and its lookups, ``take``, read the panels in place);
``as_arrays`` undoes it (to save, convert or shard).

Who calls it: ``jaxspec.load`` lays out what it loads where ``wanted`` (a CPU backend with the
kernel on, no mesh), so a loaded model holds one copy of its weights, in panels; ``generate``
lays out a params tree of the user's that is not yet (``for_run``: once per tree, cached while
its arrays live), which holds a second copy of those weights beside the user's.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref

import jax
import jax.numpy as jnp

from jaxspec.kernels import cpu_matmul

PANEL = cpu_matmul.PANEL
# The params keys of a decoder layer (``jaxspec.models.decoder``) that are ``[K, N]`` projection
# matrices read only through ``models.linear``: the ones ``for_kernel`` lays out.
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Panels:
    """A weight matrix stored as the panels of a ``[K, N]`` product operand.

    Attributes:
      data: ``[ceil(N / 16), K, 16]``, the matrix's dtype: ``data[p, k, c] = w[k, 16 p + c]``,
        zero past N (``cpu_matmul.pack_panels``).
      n: N, the number of output columns (static).
      transposed: the matrix is ``w``'s transpose, ``[N, K]`` (static): a tied embedding table
        ``[V, D]`` laid out as the output head ``[D, V]`` it also is; its rows (the lookups) are
        the panels' columns. ``linear`` takes it with ``transposed=True``, as the table itself.
    """

    data: jax.Array
    n: int = dataclasses.field(metadata=dict(static=True))
    transposed: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        """The matrix's logical shape: ``(K, N)``, or ``(N, K)`` when ``transposed``."""
        k = self.data.shape[-2]
        return (self.n, k) if self.transposed else (k, self.n)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    ndim = 2

    def unpack(self) -> jax.Array:
        """The matrix (``shape``) as an array."""
        w = cpu_matmul.unpack_panels(self.data, self.n)
        return w.T if self.transposed else w

    def __array__(self, dtype=None, copy=None):
        import numpy as np

        return np.asarray(self.unpack(), dtype=dtype)

    def take(self, idx: jax.Array, axis: int) -> jax.Array:
        """``jnp.take(self.unpack(), idx, axis=axis)`` (``idx`` integer, any shape, in range).
        Along the panels' N axis (the rows of a ``transposed`` table: embedding lookups) it reads
        the panels in place, one strided gather, without unpacking them."""
        n_axis = 0 if self.transposed else 1
        if axis not in (0, 1, -1, -2):
            raise ValueError(f"Panels.take: axis must be 0 or 1 (a matrix), got {axis}")
        if axis % 2 != n_axis:
            return jnp.take(self.unpack(), idx, axis=axis)
        cols = self.data[idx // PANEL, :, idx % PANEL]  # [*idx.shape, K]
        return cols if self.transposed else jnp.moveaxis(cols, -1, 0)

    def take_flat(self, idx: jax.Array) -> jax.Array:
        """The matrix's elements at flat (row-major, logical ``shape``) indices ``idx``, read
        from the panels without unpacking them."""
        rows, cols = self.shape
        r, c = idx // cols, idx % cols
        k, n = (c, r) if self.transposed else (r, c)
        return self.data[n // PANEL, k, n % PANEL]


def take(w, idx: jax.Array, axis: int = 0) -> jax.Array:
    """``jnp.take(w, idx, axis=axis)`` for a matrix given as an array or as ``Panels`` (an
    embedding lookup is ``take(params["embed"], tokens)``)."""
    if isinstance(w, Panels):
        return w.take(idx, axis)
    return jnp.take(w, idx, axis=axis)


def pack(w: jax.Array, transposed: bool = False) -> Panels:
    """``w [K, N]`` (any float dtype) as ``Panels`` (a copy of the weights in the new layout);
    with ``transposed``, ``w [N, K]`` (a tied embedding table) as the panels of ``w.T``.

    Raises:
      ValueError: ``w`` is not 2-D.
    """
    if w.ndim != 2:
        raise ValueError(f"pack takes a 2-D matrix, got shape {tuple(w.shape)}")
    if transposed:
        return Panels(cpu_matmul.pack_panels(w.T), int(w.shape[0]), True)
    return Panels(cpu_matmul.pack_panels(w), int(w.shape[1]))


def _head_key(params: dict) -> str:
    """The params key of a decoder's output head: ``lm_head`` ``[D, V]``, or the tied ``embed``."""
    return "lm_head" if "lm_head" in params else "embed"


def for_kernel(params: dict) -> dict:
    """A decoder's ``params`` (``jaxspec.models.decoder``) with the matrices its products read
    as ``Panels``: every layer's projections (``PROJECTIONS``) and the output head (an untied
    ``lm_head``, or a tied ``embed`` table as transposed panels, which lookups read in place);
    everything else (norms, biases, an untied model's ``embed``) the same arrays. Matrices
    already in panels are kept. A copy of those weights: keep one of the two trees, not both,
    where memory is short."""
    layers = [{key: pack(w) if key in PROJECTIONS and not isinstance(w, Panels) else w for key, w in layer.items()}
              for layer in params["layers"]]
    out = {**params, "layers": layers}
    head = _head_key(params)
    if head in params and not isinstance(params[head], Panels):
        out[head] = pack(params[head], transposed=head == "embed")
    return out


def as_arrays(params):
    """``params`` with every ``Panels`` leaf back as its ``[K, N]`` array (any pytree)."""
    return jax.tree.map(lambda w: w.unpack() if isinstance(w, Panels) else w, params,
                        is_leaf=lambda w: isinstance(w, Panels))


def has_panels(params) -> bool:
    """Whether any matrix in ``params`` is laid out in panels."""
    leaves = jax.tree.leaves(params, is_leaf=lambda w: isinstance(w, Panels))
    return any(isinstance(w, Panels) for w in leaves)


def wanted(config, mesh=None) -> bool:
    """Whether params of ``config`` run laid out in panels here: jaxspec's decoder (a
    ``ModelConfig``, not a model of the user's own), no mesh, the default backend CPU and the
    kernel's products and panels on (``cpu_matmul.active``; ``cpu_matmul.disabled("panels")``
    keeps plain matrices plain, for an A/B)."""
    from jaxspec.config import ModelConfig

    return (isinstance(config, ModelConfig) and mesh is None and jax.default_backend() == "cpu"
            and cpu_matmul.active("matmul") and cpu_matmul.active("panels"))


def _is_decoder_params(params) -> bool:
    return (isinstance(params, dict) and isinstance(params.get("layers"), (list, tuple))
            and all(isinstance(layer, dict) for layer in params["layers"]))


_LAID_OUT: collections.OrderedDict = collections.OrderedDict()  # ids of the matrices -> (weak refs, laid out)
_KEEP = 4  # params trees whose laid-out copies ``for_run`` keeps


def for_run(params, config, mesh=None):
    """``params`` as ``generate`` runs them: ``for_kernel(params)`` where ``wanted(config, mesh)``
    and the tree is a decoder's with matrices not yet in panels, else ``params`` unchanged.
    The copy is made once per tree and reused while the tree's arrays live (the last ``_KEEP``
    trees), so a loop of ``generate`` calls over the same params pays it once."""
    if not (_is_decoder_params(params) and wanted(config, mesh)):
        return params
    mats = [layer[key] for layer in params["layers"] for key in PROJECTIONS if key in layer]
    if _head_key(params) in params:
        mats.append(params[_head_key(params)])
    if not mats or all(isinstance(w, Panels) for w in mats):
        return params
    key = tuple(id(w) for w in mats)
    hit = _LAID_OUT.get(key)
    if hit is not None and all(ref() is w for ref, w in zip(hit[0], mats)):
        _LAID_OUT.move_to_end(key)
        return hit[1]
    laid_out = for_kernel(params)
    _LAID_OUT[key] = ([weakref.ref(w) for w in mats], laid_out)
    while len(_LAID_OUT) > _KEEP:
        _LAID_OUT.popitem(last=False)
    return laid_out
