"""A Hugging Face model, as a new user brings one: trains, resumes byte-identically, exports for from_pretrained."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
import transformers  # the test extra installs it: imported, never skipped

import plugin_models
from conftest import assert_resumed_once, run_on_harness, shard_bytes, tiny_config
from ray_resume import cli
from ray_resume.checkpoint.loader import load_state
from ray_resume.checkpoint.reader import open_iteration
from ray_resume.checkpoint.storage import LocalStorage

HF = {"model": {"builder": "plugin_models:build_gpt2"}, "training": {"loss": "plugin_models:hf_loss"}}


@pytest.mark.invariant(2)
def test_gpt2_trains_resumes_byte_identical_and_exports_for_from_pretrained(tmp_path):
    """GPT2LMHeadModel (tied embeddings, dropout on): a rank killed after step 6 ends with every shard
    of iteration 12 equal to the uninterrupted run's; the export loads with from_pretrained, and with a
    strict load_state_dict, to the checkpoint's weights and the same logits."""
    roots = {}
    for name, fault in (("clean", None), ("killed", {"phase": "after_optimizer_step", "step": 6, "rank": 1})):
        cfg = tiny_config(tmp_path / name, fault=fault, **HF)
        run_on_harness(cfg)
        roots[name] = cfg["checkpoint"]["save_path"]
    assert_resumed_once(roots["killed"])
    assert shard_bytes(roots["killed"], 12) == shard_bytes(roots["clean"], 12)

    plain_export = tmp_path / "plain-export"  # without --rebuild-model nothing of the config.yaml is imported
    assert cli.main(["export", roots["clean"], str(plain_export)]) == 0
    assert not (plain_export / "config.json").exists()
    assert "lm_head.weight" not in safetensors.torch.load_file(plain_export / "model.safetensors")
    out = tmp_path / "export"
    assert cli.main(["export", roots["clean"], str(out), "--rebuild-model"]) == 0
    assert (out / "config.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    plain = plugin_models.build_gpt2(tiny_config(tmp_path)["model"])
    plain.load_state_dict(safetensors.torch.load_file(out / "model.safetensors"))  # strict: lm_head.weight is there too
    saved = load_state(LocalStorage(), open_iteration(LocalStorage(), roots["clean"], 12), "model")
    assert set(saved) == set(plain.state_dict()) - {"lm_head.weight"}  # the tied weight stored once, under its first name
    for name, tensor in saved.items():
        assert torch.equal(plain.state_dict()[name].reshape(-1), tensor.reshape(-1)), name
        assert torch.equal(hf.state_dict()[name].reshape(-1), tensor.reshape(-1)), name
    plain.eval()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert not hf.training and torch.equal(hf(input_ids=ids).logits, plain(input_ids=ids).logits)
