"""ddpad as the graph padder of nvalchemi-toolkit's domain decomposition.

nvalchemi (0.2) pads each rank's halo graph itself when a model runs under
``DistributedModel(..., compile=True)`` / ``DomainConfig(compile=True)``,
through the ``GraphPadder`` declared in the model's
``CompilePolicy(graph_padder=...)``. This module supplies ddpad padders for
both of its paths:

* **halo path** -- the framework calls ``pad(batch, cap_state)`` on its own
  ``Batch`` inside its agreement scope, ignores the return value and puts the
  batch's original storage back itself. :class:`BatchPadder` pads the batch's
  atom and edge storage groups in place.
* **model-internal path** (UMA style) -- the wrapper calls
  ``current_dd_context().maybe_pad_graph(data)``, then the framework calls
  ``unpad(output)`` and ``restore()``; nvalchemi agrees no caps there.
  :class:`AgreedPadder` wraps any padder and agrees its caps over the DD mesh.

Against nvalchemi's built-in padder, caps are agreed with ONE all-reduce for
all keys of a step (theirs: one blocking all-reduce per key), dead edges are
longer than the cutoff whatever the cell (theirs use the ``[1, 0, 0]`` image,
shorter than the cutoff in a small cell, and zero without one), and
``restore()`` exists on every padder.

Hand a padder to nvalchemi with :func:`spec_with_padder` (for a
``DistributedModel`` you build) or :func:`use_padder` (for ``DomainParallel``,
which builds its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from .._agreement import Agreement, cap_agreement_group
from .._capacity import CapPolicy, CapScope, ScopedCaps, TightCaps, resolutions
from .._compile import counting_backend
from .._options import check_cap_policy, tight_sizing
from .._padders import COOPadder
from .._protocol import GraphPadder
from .._stats import Stats
from .._store import storable
from .._version import install_command

__all__ = ["AgreedPadder", "BatchPadder", "gloo_exchange", "spec_with_padder", "use_padder"]

INSTALL_HINT = f"{install_command('nvalchemi')}  (nvalchemi-toolkit==0.2.0)"

# nvalchemi's Batch field names (nvalchemi.data.Batch, COO neighbour format)
_POSITIONS = "positions"
_NEIGHBORS = "neighbor_list"  # [E, 2]; endpoints >= n_real are sentinels
_SHIFTS = "neighbor_list_shifts"  # [E, 3] integer lattice images


def _nvalchemi_graph_padder() -> Any:
    """nvalchemi's padder module, or an ImportError naming the install."""
    try:
        from nvalchemi.distributed import graph_padder
    except ImportError as exc:
        raise ImportError(f"ddpad.engines.nvalchemi needs nvalchemi-toolkit: {INSTALL_HINT}") from exc
    return graph_padder


def _dd_mesh_group() -> Any:
    """The process group of the live nvalchemi DD context's mesh, or None."""
    from nvalchemi.distributed._core.context import current_dd_context
    from nvalchemi.distributed._core.gather_primitives import mesh_group

    return mesh_group(getattr(current_dd_context(), "mesh", None))


@contextlib.contextmanager
def _agreement(group: Any, device: torch.device | str | None) -> Iterator[Agreement | None]:
    """Agree caps over ``group``; else over the group nvalchemi made ambient
    for its padding scope (halo path); else over the live DD context's mesh
    (model-internal path, where nvalchemi agrees nothing). Outside any of
    them (single process) nothing is agreed."""
    gp = _nvalchemi_graph_padder()
    if group is None:
        # read-only use of nvalchemi's ambient scope: the framework owns it
        ambient = gp._CAP_AGREEMENT.get()
        if ambient is not None:
            group, device = ambient
        else:
            group = _dd_mesh_group()
    if group is None:
        yield None
        return
    # nvalchemi's own resolve_cap (e.g. its UMA padder, wrapped by
    # AgreedPadder) agrees under its scope; ddpad's under ours.
    with gp.cap_agreement_group(group, device), cap_agreement_group(group, device) as agreement:
        yield agreement


CapPolicyName = Any  # "tight", "headroom", a TightPolicy or None


class _Accounting:
    """Stats of the pads: calls, caps, growths, fits, fill, collectives; a
    counting compile backend for the engine's own ``torch.compile``; and the
    caps' sizing (``cap_policy``, as :func:`ddpad.wrap`'s: ``"tight"`` fits
    them to the needs of the first pads, agreed over the ranks, so every rank
    fits the same caps on the same pad; ``None``: tight once
    :meth:`compile_kwargs` bound a compile store, where the fit's one more
    compile is found again by the next process)."""

    def __init__(self, group: Any, device: torch.device | str | None, cap_policy: CapPolicyName = None) -> None:
        check_cap_policy(cap_policy)
        self.group = group
        self.device = device
        self.stats = Stats()
        #: all-reduces issued by this padder's cap agreement (one per pad)
        self.collectives = 0
        self._pads = 0
        self._policy = cap_policy
        self._sizer: TightCaps | None = None
        self._size(cheap=False)

    @property
    def tight(self) -> bool:
        """Whether the caps are fitted to the needs (``cap_policy``)."""
        return self._sizer is not None

    def _size(self, cheap: bool) -> None:
        """Size the caps as ``cap_policy`` says, ``None`` tight where a growth
        is ``cheap`` (a compile store keeps the fit's compile); before the
        first pad only."""
        policy = tight_sizing(self._policy, cheap)
        if policy is not None and self._sizer is None and self._pads == 0:
            self._sizer = TightCaps(policy)

    def compile_kwargs(self, backend: str = "inductor", *, compile_cache: str | os.PathLike[str] | None = None,
                       model: torch.nn.Module | None = None, **options: Any) -> dict[str, Any]:
        """``compile_kwargs`` for nvalchemi's ``DistributedModel``: compile
        with ``backend`` and count graphs into :attr:`stats`
        (``stats.graphs_by_call`` is keyed by this padder's pad count).
        With ``compile_cache`` (and the ``model`` compiled, for its key) the
        graphs go through a compile store: the ranks sharing it compile each
        graph once (one compiles, the others wait and load), and under
        ``cap_policy=None`` the caps are tight from then on. Each graph's
        first call is checked against the same graph run eagerly: one that
        disagrees runs eagerly from then on, with one warning
        (``stats.checks``, ``stats.disagreements``; ``verify=False`` opts
        out). ``options`` go to :func:`ddpad.padding.counting_backend`."""
        self._size(cheap=compile_cache is not None and storable(backend))
        return {"backend": counting_backend(self.stats, backend, compile_cache=compile_cache, model=model, **options)}

    @contextlib.contextmanager
    def _accounted(self, cap_state: dict[str, int]) -> Iterator[ScopedCaps]:
        """The pad's caps, agreed, with a scope that records what they resolved
        (``cap_state``, the framework's, is grown when the pad succeeds)."""
        sizer = self._sizer
        caps = ScopedCaps(cap_state, CapScope(sizer=sizer))
        with _agreement(self.group, self.device) as agreement:
            self.stats.calls = self._pads  # compiles in the coming forward land here
            yield caps
        cap_state.update(caps)
        self._pads += 1
        self.collectives += agreement.collectives if agreement is not None else 0
        rows = caps.scope.rows
        fitted = sizer is not None and sizer.observe_call(rows)  # (needs agreed: every rank fits on the same pad)
        resolved = resolutions(rows)
        if fitted and sizer.changing is not None:  # a changing run: caps kept, a growth on this pad is one
            self.stats.changing_run, fitted = f"step {self.stats.calls}: {sizer.changing}", False
        self.stats.record_call(self.stats.calls, resolved, {**self.stats.caps, **{r.key: r.cap for r in resolved}},
                               fitted)


class BatchPadder(_Accounting):
    """Pads nvalchemi's halo ``Batch`` (COO ``neighbor_list``) in place.

    Every per-atom field of the batch's ``atoms`` group gets dead rows up to
    the atom cap (zeros: ``atomic_numbers`` 0, zero mass), joined to the last
    system, whose owned-only energy never counts them; the dead atoms sit far
    outside the real atoms. Every per-edge field gets dead rows up to the edge
    cap: dead edges, and sentinel edges (an endpoint ``>= n_real``), join the
    dead anchor pair ``n_cap - 2 -> n_cap - 1``, ``dead_length`` apart with a
    zero lattice shift, so they are longer than the cutoff in any cell.

    Parameters
    ----------
    cutoff
        The model's cutoff (``wrapper.cutoff``); dead edges are longer.
    group, device
        The group to agree caps over and where the reduce tensor lives; by
        default the group nvalchemi's framework makes ambient.
    dead_length
        Length of dead edges (default ``2 * cutoff + 1``).
    atoms_policy, edges_policy
        Cap policies of the ``"atoms"`` and ``"edges"`` keys (ddpad's COO
        defaults).
    cap_policy
        ``"tight"``: the caps are fitted to the needs of the first pads
        (agreed over the ranks: every rank fits on the same pad, one compile
        more); ``"headroom"``: the policies' head room; ``None`` (default):
        tight once :meth:`compile_kwargs` bound a compile store (the fit's
        compile is then found again by the next process), else head room.
    """

    def __init__(
        self,
        cutoff: float,
        *,
        group: Any = None,
        device: torch.device | str | None = None,
        dead_length: float | None = None,
        atoms_policy: CapPolicy | None = None,
        edges_policy: CapPolicy | None = None,
        cap_policy: CapPolicyName = None,
    ) -> None:
        super().__init__(group, device, cap_policy)
        policies: dict[str, Any] = {}
        if atoms_policy is not None:
            policies["atoms_policy"] = atoms_policy
        if edges_policy is not None:
            policies["edges_policy"] = edges_policy
        self._coo = COOPadder(
            cutoff, positions=_POSITIONS, edge_index=_NEIGHBORS, edge_layout="E2",
            edge_fields={_SHIFTS: 0}, system_index=None, ptr=None, placement="join",
            systems_policy=None, atom_outputs=("forces", "atomic_energies"),
            dead_length=dead_length, **policies,
        )

    @property
    def caps(self) -> dict[str, int]:
        """The caps of the last pad."""
        return dict(self._coo.caps)

    @property
    def allocations(self) -> int:
        """Cap-sized buffers allocated so far (none in steady state)."""
        return self._coo.allocations

    def pad(self, data: Any, cap_state: dict[str, int], cap_atoms: bool = True) -> Any:
        """Resolve the ``"atoms"`` and ``"edges"`` caps (one all-reduce under
        agreement) and pad ``data``'s storage groups in place; returns
        ``data``. ``None`` is returned as is."""
        if data is None:
            return None
        _nvalchemi_graph_padder()
        atoms, edges = data._atoms_group, data._edges_group
        if edges is None or _NEIGHBORS not in edges.keys():  # noqa: SIM118 - a storage group, not a dict
            raise ValueError(
                f"ddpad: the batch has no {_NEIGHBORS!r} edge field; BatchPadder pads nvalchemi's "
                "COO neighbour list (NeighborListFormat.COO). Build neighbours before padding, "
                "or use nvalchemi's DenseBatchPadder for a dense neighbour matrix."
            )
        fields: dict[str, Tensor] = {k: atoms[k] for k in atoms.keys()}  # noqa: SIM118
        edge_fields: dict[str, Tensor] = {k: edges[k] for k in edges.keys()}  # noqa: SIM118
        for name in fields:
            if name != _POSITIONS:
                self._coo.atom_fields.setdefault(name, 0)
        for name in edge_fields:
            if name != _NEIGHBORS:
                self._coo.edge_fields.setdefault(name, 0)
        with self._accounted(cap_state) as caps:
            padded = self._coo.pad({**fields, **edge_fields}, caps, cap_atoms)
        n_pad = self._coo.caps["atoms"] - int(fields[_POSITIONS].shape[0])
        e_pad = self._coo.caps["edges"] - int(edge_fields[_NEIGHBORS].shape[0])
        groups = data._storage.groups
        groups["atoms"] = _grown(atoms, {k: padded[k] for k in fields}, n_pad)
        groups["edges"] = _grown(edges, {k: padded[k] for k in edge_fields}, e_pad)
        return data

    def unpad(self, output: Any, n_real: int | None = None) -> Any:
        """Slice per-atom outputs (``forces``, ``atomic_energies``) to the real
        atoms. nvalchemi's halo path never calls it (its owned-only
        consolidation drops dead rows)."""
        return self._coo.unpad(output, n_real)

    def restore(self) -> None:
        """Reset the persistent buffers' grad state (the framework puts the
        batch's own storage back itself)."""
        self._coo.restore()


def _grown(group: Any, data: Mapping[str, Tensor], extra: int) -> Any:
    """A copy of a ``SegmentedLevelStorage`` holding ``data``, its last
    segment ``extra`` rows longer (the dead rows join the last system)."""
    from nvalchemi.data.level_storage import SegmentedLevelStorage

    lengths = group.segment_lengths[: len(group)].clone()
    lengths[-1] += extra
    return SegmentedLevelStorage(
        data=dict(data), device=group.device, attr_map=group.attr_map, segment_lengths=lengths
    )


class AgreedPadder(_Accounting):
    """Any padder, its caps agreed across the DD ranks.

    For nvalchemi's model-internal path (a wrapper that builds its graph in
    ``forward`` and pads it through ``current_dd_context().maybe_pad_graph``),
    where nvalchemi agrees no caps: ranks would grow alone, recompile alone
    and fall out of step. Agreement runs over ``group``, else the live DD
    context's mesh; a ddpad padder agrees all its keys in one all-reduce, a
    padder built on nvalchemi's ``resolve_cap`` agrees key by key.

    Parameters
    ----------
    inner
        The padder to agree (a ddpad padder, or e.g. nvalchemi's UMA padder).
    group, device
        As for :class:`BatchPadder`.
    """

    def __init__(self, inner: GraphPadder, *, group: Any = None, device: torch.device | str | None = None) -> None:
        if not isinstance(inner, GraphPadder):
            raise TypeError(f"AgreedPadder needs a GraphPadder (pad/unpad), got {type(inner).__name__}")
        super().__init__(group, device)
        self.inner = inner

    def pad(self, data: Any, cap_state: dict[str, int], cap_atoms: bool = True) -> Any:
        """``inner.pad`` under agreement."""
        with self._accounted(cap_state) as caps:
            return self.inner.pad(data, caps, cap_atoms)

    def unpad(self, output: Any, n_real: int | None = None) -> Any:
        """``inner.unpad``."""
        return self.inner.unpad(output, n_real)

    def restore(self) -> None:
        """``inner.restore()`` when it has one (nvalchemi calls it after
        every model-internal forward and crashes without it)."""
        restore = getattr(self.inner, "restore", None)
        if callable(restore):
            restore()


def spec_with_padder(wrapper: Any, padder: GraphPadder, strategy: Any = None) -> Any:
    """``wrapper``'s nvalchemi ``MLIPSpec`` with ``padder`` as its graph padder.

    Pass the result as ``DistributedModel(wrapper, config, spec=...)``.

    Raises
    ------
    ValueError
        When the wrapper declares no distribution spec or no compile policy.
    """
    _nvalchemi_graph_padder()
    return _spec_with(getattr(wrapper, "distribution_spec", None), strategy, padder, wrapper)


def _spec_with(spec_of: Any, strategy: Any, padder: GraphPadder, wrapper: Any) -> Any:
    spec = spec_of(strategy) if callable(spec_of) else spec_of
    if spec is None or spec.compile is None:
        raise ValueError(
            f"{type(wrapper).__name__} declares no nvalchemi distribution spec with a "
            "CompilePolicy; nvalchemi only pads compiled DD forwards of models that do"
        )
    return spec.with_compile(dataclasses.replace(spec.compile, graph_padder=padder))


@contextlib.contextmanager
def use_padder(wrapper: Any, padder: GraphPadder) -> Iterator[Any]:
    """Within the block, ``wrapper.distribution_spec(...)`` declares ``padder``.

    For ``DomainParallel``, which builds its ``DistributedModel`` from the
    wrapper's spec in ``partition()`` (or at the first ``run()``): call that
    inside the block. Only this wrapper instance is touched, and its own
    ``distribution_spec`` is back when the block exits.
    """
    _nvalchemi_graph_padder()
    original = wrapper.distribution_spec
    had_own = "distribution_spec" in vars(wrapper)

    def with_padder(strategy: Any = None) -> Any:
        return _spec_with(original, strategy, padder, wrapper)

    object.__setattr__(wrapper, "distribution_spec", with_padder)
    try:
        yield wrapper
    finally:
        if had_own:
            object.__setattr__(wrapper, "distribution_spec", original)
        else:
            del wrapper.__dict__["distribution_spec"]


@contextlib.contextmanager
def gloo_exchange() -> Iterator[None]:
    """Within the block, physicsnemo's ``indexed_all_to_all_v_wrapper`` (used
    by nvalchemi's atom migration and its non-p2p halo exchange) runs as
    point-to-point sends and receives, which gloo supports; gloo's
    ``all_to_all`` requires equal chunk sizes and fails on the first uneven
    migration. For CPU runs over gloo; NCCL needs nothing. The original
    function is back when the block exits.
    """
    try:
        from physicsnemo.distributed import utils
    except ImportError as exc:
        raise ImportError(f"gloo_exchange needs physicsnemo (installed with nvalchemi-toolkit): {INSTALL_HINT}") from exc
    original = utils.indexed_all_to_all_v_wrapper
    utils.indexed_all_to_all_v_wrapper = _indexed_all_to_all_v_p2p
    try:
        yield
    finally:
        utils.indexed_all_to_all_v_wrapper = original


def _indexed_all_to_all_v_p2p(
    tensor: Tensor, indices: list[Tensor], sizes: list[list[int]], dim: int = 0, group: Any = None
) -> Tensor:
    """physicsnemo's indexed all-to-all-v (same arguments and result) over
    ``isend`` / ``irecv``: rows ``tensor[indices[r]]`` go to rank ``r``;
    ``sizes[s][r]`` rows come from rank ``s``, concatenated in rank order."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    sends = [tensor.index_select(dim, idx.to(tensor.device)).contiguous() for idx in indices]
    recvs = []
    for src in range(world):
        shape = list(tensor.shape)
        shape[dim] = int(sizes[src][rank])
        recvs.append(tensor.new_empty(shape))
    ops = []
    for peer in range(world):
        if peer == rank:
            recvs[peer].copy_(sends[peer])
            continue
        global_peer = dist.get_global_rank(group, peer) if group is not None else peer
        if sends[peer].numel():
            ops.append(dist.P2POp(dist.isend, sends[peer], global_peer, group))
        if recvs[peer].numel():
            ops.append(dist.P2POp(dist.irecv, recvs[peer], global_peer, group))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return torch.cat(recvs, dim=dim)
