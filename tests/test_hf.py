"""A Hugging Face model, as a fine-tuning user brings one (`from_pretrained` in the builder): trains,
resumes byte-identically with a rank killed, and exports, without importing anything, for
`from_pretrained` (config.json and every tied name, taken from the live model at save time)."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
import transformers  # the test extra installs it: imported, never skipped

import plugin_models
from conftest import KILL_AT_6, assert_resumed_once, run_on_harness, shard_bytes, tiny_config
from ray_resume import cli
from ray_resume.checkpoint.loader import load_state
from ray_resume.checkpoint.io.iterations import open_iteration
from ray_resume.checkpoint.io.storage import LocalStorage

CONFIGS = {  # two architectures whose output head is their input embedding
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    ),  # dropout on (0.1): the rank's RNG is in the checkpoint
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=True,
    ),
}


def pretrained(tmp_path, arch: str):
    """A model directory as the Hub gives one: config.json and model.safetensors."""
    base = tmp_path / f"{arch}-base"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(CONFIGS[arch]()).save_pretrained(base)
    return base


def job(tmp_path, base, *, wrap=False, strategy="ddp") -> dict:
    return tiny_config(
        tmp_path,
        model={"builder": "plugin_models:hf_from_pretrained", "args": {"path": str(base), "wrap": wrap}},
        training={"loss": "plugin_models:hf_loss", "strategy": strategy},
    )


def exported(root, out) -> None:
    assert cli.main(["export", str(root), str(out)]) == 0  # no --rebuild-model: nothing of the job is imported


def loads_as_the_checkpoint(root, out, base, prefix: str = "") -> None:
    """from_pretrained(out): no missing or unexpected key, every weight the checkpoint's, and the logits of
    the builder's model with the export loaded strictly."""
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info
    saved = load_state(LocalStorage(), open_iteration(LocalStorage(), str(root), 12), "model")
    assert {n[len(prefix) :] for n in saved} <= set(hf.state_dict())
    for name, tensor in saved.items():
        assert torch.equal(hf.state_dict()[name[len(prefix) :]].reshape(-1), tensor.reshape(-1)), name
    plain = transformers.AutoModelForCausalLM.from_pretrained(base)
    # strict: the tied names are there too
    plain.load_state_dict(safetensors.torch.load_file(out / "model.safetensors"))
    plain.eval()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert not hf.training and torch.equal(hf(input_ids=ids).logits, plain(input_ids=ids).logits)


@pytest.mark.invariant(2)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_from_pretrained_trains_resumes_byte_identical_and_exports_for_from_pretrained(tmp_path, arch):
    base = pretrained(tmp_path, arch)
    roots = {}
    for name, fault in (("clean", None), ("killed", KILL_AT_6)):
        cfg = job(tmp_path / name, base)
        run_on_harness(cfg, fault, controller="CommitsFirst")  # 4 committed before the kill
        roots[name] = cfg["checkpoint"]["save_path"]
    assert_resumed_once(roots["killed"])
    assert shard_bytes(roots["killed"], 12) == shard_bytes(roots["clean"], 12)

    out = tmp_path / "export"
    exported(roots["killed"], out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [{"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[arch]]
    # stored once, exported under both names
    assert "lm_head.weight" in safetensors.torch.load_file(out / "model.safetensors")
    assert "lm_head.weight" not in load_state(
        LocalStorage(), open_iteration(LocalStorage(), roots["killed"], 12), "model"
    )
    loads_as_the_checkpoint(roots["killed"], out, base)


@pytest.mark.invariant(2)
def test_under_fsdp2_and_inside_a_wrapper_of_the_users_the_export_is_the_transformers_model(tmp_path):
    """FSDP2 (fully_shard renames the class: config.json still names GPT2LMHeadModel), the transformers model
    inside a module of the user's (its tensors under "lm."): the export holds the inner model's own names."""
    base = pretrained(tmp_path, "gpt2")
    cfg = job(tmp_path / "fsdp-wrapped", base, wrap=True, strategy="fsdp")
    run_on_harness(cfg)
    out = tmp_path / "export"
    exported(cfg["checkpoint"]["save_path"], out)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    loads_as_the_checkpoint(cfg["checkpoint"]["save_path"], out, base, prefix="lm.")
    wrapper = plugin_models.hf_from_pretrained({"args": {"path": str(base), "wrap": True}})
    # strict, into the builder's model
    wrapper.lm.load_state_dict(safetensors.torch.load_file(out / "model.safetensors"))


@pytest.mark.invariant(6)
def test_export_facts_that_do_not_hold_are_refused_and_without_them_rebuild_model_finds_them(tmp_path, capsys):
    """Facts that do not hold: exit 1 naming the key. An older root (no ray_resume.model in metadata.json):
    the weights alone and a note; --rebuild-model builds the model of its config.yaml on the meta device
    to find the tied names and the config (a builder that makes the model from a config can be; one that
    calls from_pretrained cannot)."""
    base = pretrained(tmp_path, "gpt2")
    cfg = tiny_config(
        tmp_path / "run", model={"builder": "plugin_models:build_gpt2"}, training={"loss": "plugin_models:hf_loss"}
    )
    run_on_harness(cfg)
    root = cfg["checkpoint"]["save_path"]
    meta_file = tmp_path / "run" / "ckpt" / "iteration_00000012" / "metadata.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(
        json.dumps({**meta, "ray_resume": {**meta["ray_resume"], "model": {"tied": {"lm_head.weight": 3}}}})
    )
    assert cli.main(["export", root, str(tmp_path / "refused")]) == 1
    assert "metadata.json: ray_resume.model.tied must map tensor names to tensor names" in capsys.readouterr().err

    del meta["ray_resume"]["model"]
    meta_file.write_text(json.dumps(meta))
    plain = tmp_path / "plain"
    exported(root, plain)
    assert "--rebuild-model builds its model here" in capsys.readouterr().out
    assert not (plain / "config.json").exists() and "lm_head.weight" not in safetensors.torch.load_file(
        plain / "model.safetensors"
    )
    rebuilt = tmp_path / "rebuilt"
    assert cli.main(["export", root, str(rebuilt), "--rebuild-model"]) == 0
    loads_as_the_checkpoint(root, rebuilt, base)
