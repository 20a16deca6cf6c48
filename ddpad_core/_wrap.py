"""Building a wrapped model: the three constructors, and which one to call.

:func:`wrap` is what users call (``adapter.wrap(model)`` is the same);
:func:`padded_model` is :func:`wrap` for a model the adapter has already
prepared (what a background worker rebuilds); :class:`~ddpad.PaddedModel`
takes the padder and the adapter's hooks directly (tests, frameworks with
their own padder). All three read their options through one record,
:class:`~._options.WrapOptions`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ._noise import quiet
from ._padded import PaddedModel
from ._protocol import GraphPadder

from ._registry import resolve_adapter

if TYPE_CHECKING:
    from ._adapter import Adapter

__all__ = ["padded_model", "wrap"]


def wrap(model: torch.nn.Module, adapter: Adapter | str, *, padder: GraphPadder | None = None,
         **options: Any) -> PaddedModel:
    """Wrap ``model`` so it always runs at fixed padded shapes.

    Calls on one wrapped model are serialised: two threads calling it at
    once take turns (a padder's buffers are the model's one input).

    Parameters
    ----------
    model
        The model, called with its native input. It stays the model that
        runs: an adapter's compile-ready copy holds its tensors, and any
        other change to it after ``wrap`` prepares the copy again (one
        warning; docs/pages/contract.md, "Your weights").
    adapter
        An :class:`~ddpad.adapters.Adapter` or a registered name (``"mace"``).
    padder
        Override the adapter's padder.

    Other Parameters
    ----------------
    compile
        Compile the model with ``torch.compile`` (default True; ``dynamic=False``
        unless given); ``backend``, ``mode``, ``fullgraph``, ``options`` pass through.
    caps
        Preset caps: a dict or a JSON file from :meth:`PaddedModel.save_caps`.
    on_recompile
        What to do when a graph compiles that no cap change explains:
        ``"warn"`` (default), ``"raise"`` (:class:`RecompileError`), ``"ignore"``.
    shrink
        A :class:`ShrinkPolicy` to let caps shrink after long low fill; off by default.
    max_caps
        Per-key ceilings (``{"edges": 200_000}``): a growth stops there, and a
        need beyond raises :class:`CapacityError` (or see ``on_overflow``).
    memory_budget
        Bytes a step may use (CUDA): ceilings are derived from the first
        step's measured peak, assuming memory linear in every cap.
    on_overflow
        ``"raise"`` (default) or ``"eager"``: run a step whose need exceeds a
        ceiling unpadded and eager, and carry on.
    compile_cache
        A directory (or :class:`CompileStore`) keeping what compiling
        produced, keyed by the model's architecture, caps, backend and
        versions: a later process (a restart, the next job, another rank)
        loads instead of compiling, and processes compiling the same graph
        at once compile it once (the others wait and load).
    background_compile
        A fill threshold (e.g. ``0.9``; needs ``compile_cache``): when a cap's
        fill passes it, a worker process compiles the next rung into the
        store, so the growth only loads. Stop workers with
        :meth:`PaddedModel.close` or a ``with`` block (also done at exit).
    background_workers
        At most this many background compiles (or, under
        ``compile_mode="aot"``, package builds) at once (default 1).
    warm_ladder
        The first call also compiles (or, from ``compile_cache``, loads) the
        next ``warm_ladder`` rungs of caps, each one growth up in every count
        but the number of systems; a later growth takes the smallest rung
        that fits and runs a ready graph: no stall in the run, a longer first
        call, and caps up to one rung larger than a growth alone would pick.
        Off under an agreement group.
    cap_policy
        ``"tight"``: after ten calls fit every cap to the needs seen (fill
        about 0.97), then grow in small steps (a :class:`TightPolicy` sets
        the window and margin); ``"headroom"``: the padders' own policies;
        ``None`` (default): tight where a growth is cheap (``compile=False``,
        a compile store, background compiles or a warm ladder), head room
        otherwise.
    compile_mode
        ``"dynamo"`` (default): ``torch.compile``. ``"aot"``: each caps and
        call form's whole step is traced, exported and compiled by
        AOTInductor into a package (kept in ``compile_cache``, loaded by
        later processes instead of traced); its first call in a process is
        checked against the eager step; a change to the model's weights or
        hyper-parameters is noticed before the next call and the package of
        the model as it now is used; a step the route cannot take falls
        back to ``torch.compile`` with one line saying why.
    aot_build
        Where ``compile_mode="aot"`` builds a package the store lacks:
        ``"background"`` (the default with a compile store and an
        adapter a worker can rebuild: a built-in's or a plugin's, or one
        that pickles): a worker process builds it (``background_workers`` at
        once) while this run uses ``torch.compile`` at those caps, and
        switches to the package once it is in the store; every later process
        loads it. ``"foreground"`` (the default otherwise): the call
        that needs it builds it (an AOTInductor build is several times a
        ``torch.compile``; see docs/pages/compile-store.md).
    verify
        ``True`` (default): the first call of every compiled graph and
        package (each caps and call form) also runs the eager model on the
        same padded input and compares every output at the tolerance of the
        least precise dtype at work; a disagreement returns the eager result
        and those caps fall back one route (package -> ``torch.compile`` ->
        eager), with one warning. One eager step per compiled graph; nothing
        on a steady call. ``False`` returns whatever the compiler made.
    compile_kwargs
        What else goes to ``torch.compile`` (``{"disable": ...}``); its
        ``backend``, ``mode``, ``fullgraph``, ``dynamic`` and ``options`` are
        also taken by name. Any other keyword is a ``TypeError`` here,
        naming the closest option (a typo fails at ``wrap``, not inside
        Dynamo, and never enters the store's key).
    """
    adapter = resolve_adapter(adapter)
    source = None
    if adapter.prepare_model is not None:
        with quiet():  # the model package's known warnings, raised because ddpad prepares the model
            model, source = adapter.prepare_model(model), model
    return padded_model(model, adapter, padder=padder, source=source, **options)


def padded_model(model: torch.nn.Module, adapter: Adapter, *, padder: GraphPadder | None = None,
                 source: torch.nn.Module | None = None, **options: Any) -> PaddedModel:
    """:func:`wrap` for a model ``adapter.prepare_model`` has already prepared
    (from ``source``: what a worker prepares again; what a background worker
    rebuilds)."""
    wrapped = PaddedModel(
        model,
        padder if padder is not None else adapter.make_padder(model),
        adapter=adapter,
        source=source,
        pad_in_forward=adapter.pad_in_forward,
        call=adapter.call,
        dynamo_config=adapter.dynamo_config,
        compile_region=adapter.compile_region,
        **options,
    )
    if padder is None:  # made here: made again for a model prepared again
        wrapped._remake_padder = adapter.make_padder
    return wrapped
