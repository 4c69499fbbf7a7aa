"""Checkpoint conversion of tied weights (gradmgr.parity.save_map / convert_checkpoint,
docs/porting.md "Converting checkpoints") between PyTorch and MegEngine, and within each: an
LM head on its embedding's weight (``lm``), two Linears on one weight (``shared``), one Linear
under two names (``shared_layer``, which MegEngine's state dict lists once), one module's
weight under two attribute names (``own``, listed once too). Every case ends
in a conversion checked bit for bit and loaded strictly, or in a MappingError naming the two
tensors (tests/parity_tied_checks.py); forwards within 1e-5 of the largest output (two
frameworks' float32 kernels)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mge = pytest.importorskip("megengine")

import parity_small_mge as G  # noqa: E402
import parity_small_torch as T  # noqa: E402
from parity_tied_checks import (  # noqa: E402
    check_edited_tied_checkpoint,
    check_tied_checkpoint,
    check_untied_into_tied,
    save_state,
)

from gradmgr.parity import ParityError, convert_checkpoint, dump, save_map  # noqa: E402

RS = np.random.RandomState(0)
BATCHES = {"lm": RS.randint(0, 10, (4, 5)), "shared": RS.randn(4, 8).astype(np.float32),
           "shared_layer": RS.randn(4, 8).astype(np.float32),
           "own": RS.randn(4, 8).astype(np.float32)}
CLASSES = {"torch": {"lm": T.TiedLM, "shared": T.Shared, "shared_layer": T.SharedLayer,
                     "own": T.TiedInOneModule},
           "megengine": {"lm": G.TiedLM, "shared": G.Shared, "shared_layer": G.SharedLayer,
                         "own": G.TiedInOneModule}}
TIES = {"lm": ("head.weight", "emb.weight"), "shared": ("b.weight", "a.weight"),
        "shared_layer": ("b.weight", "a.weight"), "own": ("core.w2", "core.w")}
# the tied names MegEngine's state dict lists once
LISTED_ONCE = {"shared_layer": ["b.bias", "b.weight"], "own": ["core.w2"]}
REL = 1e-5


def maker(framework: str, case: str, tied: bool):
    def make(seed: int):
        torch.manual_seed(seed)
        mge.random.seed(seed)
        return CLASSES[framework][case](tied)
    return make


@pytest.mark.parametrize("case", ["lm", "shared", "shared_layer", "own"])
@pytest.mark.parametrize("src,dst", [("torch", "torch"), ("torch", "megengine"),
                                     ("megengine", "megengine")])
def test_tied_on_both_sides_converts_bit_for_bit_and_keeps_the_tie(src, dst, case, tmp_path):
    written = check_tied_checkpoint(maker(src, case, True), maker(dst, case, True),
                                    BATCHES[case], str(tmp_path), REL)
    # MegEngine's state dict lists a layer shared under two names once: so does its file
    listed_once = {"src": [], "dst": []}
    for side, framework in (("src", src), ("dst", dst)):
        if framework == "megengine":
            listed_once[side] = LISTED_ONCE.get(case, [])
    assert written["unlisted"] == listed_once


@pytest.mark.parametrize("case", ["lm", "shared", "shared_layer", "own"])
@pytest.mark.parametrize("tied,untied", [("torch", "torch"), ("torch", "megengine"),
                                         ("megengine", "torch")])
def test_tied_on_one_side_never_picks_one_of_two_values(tied, untied, case, tmp_path):
    check_untied_into_tied(maker(tied, case, True), maker(untied, case, False), BATCHES[case],
                           str(tmp_path), *TIES[case], rel=REL)


@pytest.mark.parametrize("case", ["lm", "shared"])
@pytest.mark.parametrize("src,dst", [("torch", "megengine"), ("megengine", "torch")])
def test_a_tied_checkpoint_whose_two_names_differ_is_refused(src, dst, case, tmp_path):
    check_edited_tied_checkpoint(maker(src, case, True), maker(dst, case, True), BATCHES[case],
                                 str(tmp_path), *TIES[case])


def test_a_megengine_dump_keeps_the_names_its_state_dict_lists_once(tmp_path):
    x, make = BATCHES["shared_layer"], maker("megengine", "shared_layer", True)
    recorded = dump(make(0), x, str(tmp_path / "run.npz"))
    port = maker("torch", "shared_layer", True)
    live = save_map(make(0), port(1), str(tmp_path / "live.json"), probe=x)
    offline = save_map(recorded, port(1), str(tmp_path / "dump.json"), probe=x)
    assert offline == live and live["unlisted"]["src"] == ["b.bias", "b.weight"]


def test_a_map_written_before_ties_were_recorded_is_refused(tmp_path):
    """Version 1 (no ``tied`` or ``unlisted``) cannot tell an untied checkpoint's two tensors
    from one tied parameter's: refused, as is a version 2 map that lost either key."""
    make = maker("torch", "lm", True)
    path = str(tmp_path / "map.json")
    written = save_map(make(0), make(1), path, probe=BATCHES["lm"])
    save_state(make(2), str(tmp_path / "in.pth"))
    for version, lost, message in ((1, ("tied", "unlisted"), "format version 1; this gradmgr "
                                    "reads version 2 only: write the map again"),
                                   (2, ("tied",), "lacks tied: write the map again")):
        old = {k: v for k, v in written.items() if k not in lost}
        with open(path, "w") as file:
            json.dump({**old, "version": version}, file)
        with pytest.raises(ParityError, match=message):
            convert_checkpoint(str(tmp_path / "in.pth"), str(tmp_path / "out.pth"), path)
    assert not (tmp_path / "out.pth").exists()
