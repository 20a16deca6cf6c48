"""What a compile store holds, and keeping it to a size: ``ddpad cache``
(list, prune, clear) and ``CompileStore(max_size=)``."""

from __future__ import annotations

import json
import os
import pathlib
import time

import pytest

from ddpad import CompileStore
from ddpad.cli import main


def _store(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Two models' keys (mace, sevennet), a package folder, and a set-aside
    entry with its reason; entries used an hour, a day and a week ago."""
    store = CompileStore(root)
    paths = {}
    for key, adapter in (("aaaa1111", "mace"), ("bbbb2222", "sevennet")):
        (root / key).mkdir(parents=True)
        (root / key / "model.json").write_text(json.dumps({"adapter": adapter}))
    for name, key, graph, age in (("mace-old", "aaaa1111", "g1", 7), ("mace-new", "aaaa1111", "g2", 1 / 24),
                                  ("sevennet", "bbbb2222", "g3", 1), ("package", "aaaa1111-ff00", "aot-x", 2)):
        path = store.entry(key, graph)
        store.write(path, os.urandom(1000))
        stamp = time.time() - age * 86400
        os.utime(path, (stamp, stamp))
        paths[name] = path
    bad = store.entry("bbbb2222", "g4")
    store.write(bad, b"x" * 10)
    store.set_aside(bad, "refused", "disagreed with the eager step at 1 thread", quiet=True)
    return paths


def test_cache_lists_models_entries_packages_sizes_and_what_was_set_aside(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    _store(tmp_path)
    assert main(["cache", "--compile-cache", str(tmp_path), "--json"]) == 0
    keys = {row["key"]: row for row in json.loads(capsys.readouterr().out)["keys"]}
    assert (keys["aaaa1111"]["adapter"], keys["aaaa1111"]["entries"]) == ("mace", 2)
    assert (keys["aaaa1111-ff00"]["adapter"], keys["aaaa1111-ff00"]["packages"]) == ("mace", 1)
    assert keys["bbbb2222"]["set_aside"] == [{"file": "g4.refused", "kind": "refused",
                                              "reason": "disagreed with the eager step at 1 thread"}]
    assert all(row["size"] > 1000 for row in keys.values())
    assert main(["cache", "--compile-cache", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "set aside (refused): g4.refused: disagreed with the eager step at 1 thread" in table
    assert "3 key(s)" in table


def test_prune_by_age_then_to_a_size_least_recently_used_first(tmp_path: pathlib.Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    paths = _store(tmp_path)
    assert main(["cache", "prune", "--compile-cache", str(tmp_path), "--older-than", "3"]) == 0
    assert not paths["mace-old"].exists() and paths["package"].exists()
    assert main(["cache", "prune", "--compile-cache", str(tmp_path), "--max-size", "2.5K"]) == 0
    assert "removed" in capsys.readouterr().out
    left = [name for name, path in paths.items() if path.exists()]
    assert left == ["mace-new", "sevennet"], left  # the package, unused for 2 days, went first


def test_clear_an_adapters_models_and_an_unknown_one_is_one_line(tmp_path: pathlib.Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    _store(tmp_path)
    assert main(["cache", "clear", "mace", "--compile-cache", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bbbb2222"]
    assert main(["cache", "clear", "orb", "--compile-cache", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds nothing of 'orb'" in err[0] and "sevennet" in err[0]
    assert main(["cache", "prune", "--compile-cache", str(tmp_path)]) == 2  # neither bound given


def test_a_store_with_a_size_bound_keeps_it_by_least_recent_use(tmp_path: pathlib.Path) -> None:
    """Reading an entry counts as a use: the bound drops the one not read."""
    store = CompileStore(tmp_path, max_size="5K")
    first, second = store.entry("k", "a"), store.entry("k", "b")
    store.write(first, os.urandom(2000))
    store.write(second, os.urandom(2000))
    old = time.time() - 60
    os.utime(first, (old, old))
    os.utime(second, (old - 60, old - 60))
    assert store.read(second) is not None  # used now
    store.write(store.entry("k", "c"), os.urandom(2000))  # over the bound: the least recently used goes
    assert not first.exists() and second.exists() and store.entry("k", "c").exists()
    with pytest.raises(ValueError, match="is not a size"):
        CompileStore(tmp_path, max_size="lots")


def test_a_local_refusal_is_listed_with_its_setting(tmp_path: pathlib.Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    paths = _store(tmp_path)
    marker = CompileStore(tmp_path).refuse_here(paths["package"], "disagreed with the eager step")
    assert main(["cache", "--compile-cache", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"  refused on one host and setting: {marker.name}: disagreed with the eager step" in out
    assert paths["package"].exists()
