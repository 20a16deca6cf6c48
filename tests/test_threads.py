"""One wrapped model called from several threads: calls take turns (the
padder's buffers are the compiled graph's one input), never a wrong shape
or value; a call from inside a call is a clear error."""

from __future__ import annotations

import threading

import pytest
import torch

import ddpad

toy = pytest.importorskip("ddpad_toy_plugin")


def _inputs(model: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    from ase import Atoms

    g = torch.stack(torch.meshgrid(*[torch.arange(4.0)] * 3, indexing="ij"), -1).reshape(-1, 3)
    return [toy.ADAPTER.engine.build_input(model, Atoms(f"Ar{n}", positions=(g[:n] * 1.3).numpy())) for n in (20, 28, 36)]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "aot_eager"])
def test_two_threads_on_one_wrapped_model_get_their_own_results(compile: bool) -> None:
    """Before: 13-24 of 120 calls came back wrong (a 28-atom input with
    forces of shape (36, 3)): the padder kept the last pad's counts for
    ``unpad`` while both threads wrote its buffers."""
    model = toy.Morse()
    wrapped = ddpad.wrap(model, toy.ADAPTER, **({"backend": "aot_eager"} if compile else {"compile": False}))
    inputs = _inputs(model)
    expected = [toy.ADAPTER.reference(model, d) for d in inputs]
    for d in inputs:  # compile every shape first: the race is what is tested, not compile speed
        wrapped(d)
    wrong: list[str] = []
    start = threading.Barrier(2)

    def worker(offset: int) -> None:
        start.wait()
        for i in range(60):
            k = (i + offset) % len(inputs)
            try:
                out = wrapped(inputs[k])
            except Exception as exc:  # noqa: BLE001 - a race shows as an error too
                wrong.append(f"input {k}: {type(exc).__name__}: {exc}")
                continue
            ref = expected[k]
            if out["forces"].shape != ref["forces"].shape or not torch.allclose(out["forces"], ref["forces"]):
                wrong.append(f"input {k}: forces {tuple(out['forces'].shape)}")
            elif not torch.allclose(out["energy"], ref["energy"]):
                wrong.append(f"input {k}: energy")

    threads = [threading.Thread(target=worker, args=(offset,)) for offset in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [], f"{len(wrong)} of 120 calls wrong: {wrong[:5]}"
    assert wrapped.stats.calls == 120 + len(inputs)


def test_a_call_from_inside_its_own_call_is_an_error() -> None:
    model = toy.Morse()
    data = _inputs(model)[0]
    holder: list[ddpad.PaddedModel] = []

    class Reentrant(torch.nn.Module):
        reenter = True

        def forward(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return holder[0](d) if self.reenter else model(d)

    reentrant = Reentrant()
    holder.append(ddpad.PaddedModel(reentrant, toy.ADAPTER.make_padder(model), compile=False))
    with pytest.raises(RuntimeError, match="from inside its own call"):
        holder[0](data)
    reentrant.reenter = False  # the lock was released: the model is usable again
    assert holder[0](data)["forces"].shape == (20, 3)
