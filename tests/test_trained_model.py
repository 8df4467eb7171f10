"""The trained reference model: what is trained is what vLLM loads, training is deterministic,
the recipe keys the cache folder, and the built model has learned something."""

from __future__ import annotations

import json

import pytest
import torch

from flowkv._testing import trained_model as tm

TINY = {"num_layers": 2, "hidden_size": 128, "num_heads": 2, "num_kv_heads": 1, "head_dim": 64,
        "intermediate_size": 256, "vocab_size": 300, "max_position_embeddings": 64, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5}


def tiny_module(seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    module = tm._build_module(TINY)
    tm._init_weights(module, TINY, 0.2)
    return module.to(dtype)


def test_the_trained_module_is_the_llama_that_transformers_and_vllm_load(tmp_path):
    """The weights under Hugging Face names, with the config we write, compute the same logits
    in transformers' LlamaForCausalLM as in the module that trained them (RoPE halves, GQA,
    fused projections split in the right order)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    module = tiny_module()
    with torch.no_grad():  # bf16-representable weights, so saving them in bf16 loses nothing
        for param in module.parameters():
            param.copy_(param.bfloat16().float())
    save_file(tm._hf_state_dict(module, TINY), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(tm._hf_config(TINY, "0" * 64)))
    llama = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    llama.eval()
    ids = torch.randint(0, TINY["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = module(ids)
        theirs = llama(input_ids=ids).logits
    assert ours.std() > 0.1  # the logits depend on the input: the check is not between two constants
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


def test_training_is_deterministic_for_a_recipe():
    stream = torch.randint(0, TINY["vocab_size"], (5000,), generator=torch.Generator().manual_seed(2))
    train = dict(tm.RECIPE["train"], warmup_steps=2, phases=[{"seq_len": 32, "batch": 4, "steps": 3},
                                                              {"seq_len": 60, "batch": 2, "steps": 2}])

    def trained(seed: int) -> dict[str, torch.Tensor]:
        module = tiny_module(dtype=torch.bfloat16)
        losses = tm._train(module, stream, dict(train, seed=seed), progress=False)
        assert len(losses) == 5
        return tm._hf_state_dict(module, TINY)

    first, again, other = trained(0), trained(0), trained(1)
    initial = tm._hf_state_dict(tiny_module(dtype=torch.bfloat16), TINY)
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not all(torch.equal(first[name], other[name]) for name in first)  # the data order follows the seed
    assert not all(torch.equal(first[name], initial[name]) for name in first)  # and training moved the weights


def test_the_recipe_keys_the_folder(monkeypatch, tmp_path):
    digest = tm.recipe_digest()
    assert tm.model_dir(tmp_path) == tmp_path / f"trained-llama-{digest[:12]}"
    monkeypatch.setitem(tm.RECIPE, "train", dict(tm.RECIPE["train"], seed=1))
    assert tm.recipe_digest() != digest
    assert tm.model_dir(tmp_path) != tmp_path / f"trained-llama-{digest[:12]}"


def test_held_out_files_are_never_trained_on_and_hold_the_quality_prompts():
    from transformers import AutoTokenizer

    from flowkv.quality import prompt_set

    held_out, training = tm.held_out_sources(), tm.training_sources()
    assert held_out and training and not set(held_out) & set(training)
    assert held_out + training == tm._sources()
    # The default quality prompts and the demo's documents are cut from held-out files only.
    tokenizer = AutoTokenizer.from_pretrained(str(tm.trained_model(progress=False)))
    names = {f"Document: {path.name}" for path in held_out}
    for prompts, tokens in ((32, 1024), (4, 3000)):
        heads = {tokenizer.decode(ids).split("\n", 1)[0] for ids in prompt_set(tokenizer, prompts, tokens)}
        assert len(heads) == prompts and heads <= names


def test_the_built_model_has_learned_and_its_config_names_its_recipe():
    """The real build (cached after the first; `make test` builds it before the suite)."""
    path = tm.trained_model(progress=False)
    report = tm.report(path)
    config = json.loads((path / "config.json").read_text())
    assert config["flowkv_recipe_sha256"] == report["recipe_sha256"] == tm.recipe_digest()
    assert config["num_key_value_heads"] < config["num_attention_heads"] and config["head_dim"] == 64
    assert report["recipe"] == json.loads(json.dumps(tm.RECIPE))
    # ln(2048) = 7.6 nats is a model that learned nothing; a unigram model of this text is ~5.5.
    assert report["held_out_loss"] < 4.0
    # Long positions were trained too: the last quarter of 1,024-token windows is no worse than the first.
    assert report["held_out_loss_last_quarter"] <= report["held_out_loss_first_quarter"]
    assert len(report["sample_continuation"]) > 0


def test_the_shipped_build_is_copied_where_its_recipe_matches(tmp_path):
    """The set-up copies the shipped build (this recipe, this Python's training text) rather than
    train for minutes: the copy is byte for byte the shipped one, and a build of the current recipe."""
    assert tm._is_complete(tm.SHIPPED_DIR, tm.recipe_digest()), (
        "the shipped trained model is not this recipe's: `python -m flowkv._testing.trained_model --ship`")
    path = tm.trained_model(tmp_path, progress=False)
    assert path == tm.model_dir(tmp_path) and tm._is_complete(path, tm.recipe_digest())
    for name in tm._REQUIRED_FILES:
        assert (path / name).read_bytes() == (tm.SHIPPED_DIR / name).read_bytes(), name


def test_asked_to_train_it_trains_though_a_shipped_build_matches(tmp_path, monkeypatch):
    """``train=True`` (``--ship``) and ``FLOWKV_TRAIN=1`` never take the shipped copy: they train."""

    class Trained(Exception):
        pass

    def training(staging, digest, progress):
        raise Trained

    monkeypatch.setattr(tm, "_build", training)
    with pytest.raises(Trained):
        tm.trained_model(tmp_path / "a", progress=False, train=True)
    monkeypatch.setenv("FLOWKV_TRAIN", "1")
    with pytest.raises(Trained):
        tm.trained_model(tmp_path / "b", progress=False)


def test_ship_replaces_the_shipped_copy_with_a_complete_build_only(tmp_path, monkeypatch):
    build = tm.trained_model(tmp_path / "built", progress=False)  # this recipe's (the shipped build, copied)
    monkeypatch.setattr(tm, "SHIPPED_DIR", tmp_path / "shipped")
    (tmp_path / "shipped").mkdir()
    (tmp_path / "shipped" / "stale.bin").write_bytes(b"old")
    assert tm.ship(build) == tmp_path / "shipped"
    assert sorted(p.name for p in (tmp_path / "shipped").iterdir()) == sorted(
        [*tm._REQUIRED_FILES, "generation_config.json"])
    assert tm._is_complete(tmp_path / "shipped", tm.recipe_digest())
    (build / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="not a complete build"):
        tm.ship(build)
