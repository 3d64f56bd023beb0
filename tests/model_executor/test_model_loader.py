"""get_model: sharded checkpoints, and a clear error for every kind of bad checkpoint."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm.model_executor.model_loader import find_safetensors_files, get_model
from vllm.model_executor.models.registry import get_model_class, supported_architectures

from tiny_checkpoints import PagedDriver, build_checkpoint, hf_logits, make_vllm_config

ARCH = "MixtralForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    return build_checkpoint(ARCH, path), path


def _rewrite(src, dst, edit):
    """Copy checkpoint dir ``src`` to ``dst`` with its tensors dict passed through ``edit``."""
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def test_sharded_checkpoint(tmp_path, tokens):
    hf = build_checkpoint(ARCH, tmp_path, max_shard_size="20KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len(find_safetensors_files(str(tmp_path))) > 1
    model = get_model(make_vllm_config(tmp_path))
    ids = tokens(6)
    torch.testing.assert_close(PagedDriver(model).step([("s", ids)])["s"], hf_logits(hf, ids),
                               atol=1e-4, rtol=1e-4)


def test_missing_directory_and_no_safetensors(tmp_path, ckpt):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_safetensors_files(str(tmp_path / "nope"))
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(ckpt[1] / "config.json", bare / "config.json")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        get_model(make_vllm_config(bare))


def test_index_naming_a_missing_shard(tmp_path, ckpt):
    d = tmp_path / "c"
    shutil.copytree(ckpt[1], d)
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        get_model(make_vllm_config(d))


def test_missing_tensor_is_named(tmp_path, ckpt):
    name = "model.layers.1.self_attn.k_proj.weight"
    d = _rewrite(ckpt[1], tmp_path / "c", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name.replace(".", "\\.")):
        get_model(make_vllm_config(d))


def test_missing_expert_is_named(tmp_path, ckpt):
    d = _rewrite(ckpt[1], tmp_path / "c",
                 lambda t: t.pop("model.layers.0.block_sparse_moe.experts.2.w3.weight"))
    with pytest.raises(ValueError, match="experts.2.w3.*up projection of expert 2"):
        get_model(make_vllm_config(d))


def test_wrong_shape_names_tensor_and_shapes(tmp_path, ckpt):
    name = "model.layers.0.self_attn.q_proj.weight"
    d = _rewrite(ckpt[1], tmp_path / "c", lambda t: t.update({name: t[name][:-1].clone()}))
    with pytest.raises(ValueError, match=r"q_proj\.weight.*\(47, 48\).*\(48, 48\)"):
        get_model(make_vllm_config(d))
    name = "model.layers.1.block_sparse_moe.experts.0.w2.weight"
    d = _rewrite(ckpt[1], tmp_path / "e", lambda t: t.update({name: t[name][:, :-2].clone()}))
    with pytest.raises(ValueError, match=r"experts\.0\.w2\.weight.*\(48, 22\).*\(48, 24\)"):
        get_model(make_vllm_config(d))


def test_unknown_tensor_is_named_but_inv_freq_is_ignored(tmp_path, ckpt):
    d = _rewrite(ckpt[1], tmp_path / "c", lambda t: t.update({
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(6)}))
    get_model(make_vllm_config(d))
    d = _rewrite(ckpt[1], tmp_path / "e", lambda t: t.update({"model.extra.weight": torch.ones(2)}))
    with pytest.raises(ValueError, match="model\\.extra\\.weight"):
        get_model(make_vllm_config(d))


def test_unsupported_architecture_lists_supported(tmp_path, ckpt):
    d = tmp_path / "c"
    shutil.copytree(ckpt[1], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'GPT2LMHeadModel'.*MixtralForCausalLM"):
        get_model(make_vllm_config(d))
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM"):
        get_model_class("Nope")
    assert {"Qwen3MoeForCausalLM", "MixtralForCausalLM",
            "Qwen2MoeForCausalLM"} <= set(supported_architectures())
