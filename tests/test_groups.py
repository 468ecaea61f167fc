"""Model and optimizer found by what they hold, under any key (core/groups.py), and in files."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from ckpt_tools.cli.main import main as cli
from ckpt_tools.core.groups import Roots, find_roots
from ckpt_tools.errors import BadInput


def _items(prefix: tuple, opt: tuple) -> list:
    model = [((*prefix, name), True) for name in ("a.weight", "b.weight")]
    optim = [((*opt, "state", name, key), True) for name in ("a.weight", "b.weight") for key in ("exp_avg", "step")]
    groups = [((*opt, "param_groups", 0, "lr"), False), ((*opt, "param_groups", 0, "params"), False)]
    return model + optim + groups + [(("lr_scheduler", "last_epoch"), False), (("rng",), True)]


@pytest.mark.parametrize("model, opt", [(("model",), ("optim",)), (("model",), ("optimizer",)),
                                        (("app", "model"), ("app", "optim")), ((), ("optimizer",))])
def test_roots_found_by_content(model, opt):
    roots = find_roots(_items(model, opt))
    assert roots == Roots(model=model, optimizer=opt)
    assert roots.group_of((*model, "a.weight")) == "model"
    assert roots.group_of((*opt, "state", "a.weight", "exp_avg")) == "optimizer"
    assert roots.group_of(("lr_scheduler", "last_epoch")) is None


def test_no_optimizer_no_roots():
    # no optimizer: no roots; a model nested under "model" is said, so a tensor beside it
    # (torch.get_rng_state()) is not taken for a weight
    assert find_roots([(("model", "a.weight"), True), (("step",), False)]) == Roots(nested_model=True)
    assert find_roots([(("a.weight",), True), (("step",), False)]) == Roots()


def test_two_optimizers_refused():
    with pytest.raises(BadInput, match="2 optimizer states"):
        find_roots(_items(("model",), ("optim",)) + _items(("model",), ("optim2",)))


def _save_dcp(path, state):
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _state(torch):
    w = {"a.weight": torch.randn(4, 3), "b.weight": torch.randn(2, 3)}
    osd = {"state": {k: {"step": torch.tensor(3.0), "exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v)}
                     for k, v in w.items()},
           "param_groups": [{"lr": 0.1, "params": list(w)}]}
    return w, osd


def test_dcp_with_two_optimizers_exits_3(tmp_path):
    import torch

    w, osd = _state(torch)
    _save_dcp(tmp_path / "two", {"model": w, "optim": osd, "optim_b": osd})
    r = CliRunner().invoke(cli, ["inspect", str(tmp_path / "two")])
    assert r.exit_code == 3, r.output
    assert "2 optimizer states" in r.output and "Traceback" not in r.output


def test_torch_file_optim_key_is_the_optimizer(tmp_path):
    """{"model", "optim"} in one torch.save file: converted to DCP, the moments stay optimizer state."""
    import json

    import torch
    from torch.distributed.checkpoint import FileSystemReader

    w, osd = _state(torch)
    torch.save({"model": w, "optim": osd, "epoch": 3}, tmp_path / "state.pt")
    info = json.loads(CliRunner().invoke(cli, ["inspect", str(tmp_path / "state.pt"), "--json"]).output)
    assert info["groups"]["optimizer"]["num_tensors"] == 6 and info["groups"]["model"]["num_tensors"] == 2
    r = CliRunner().invoke(cli, ["convert", str(tmp_path / "state.pt"), str(tmp_path / "dcp"), "--to", "dcp", "--quiet"])
    assert r.exit_code == 0, r.output
    keys = set(FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata)
    assert "optimizer.state.a.weight.exp_avg" in keys and "model.a.weight" in keys
