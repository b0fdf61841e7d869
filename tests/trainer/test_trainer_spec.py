"""Job spec validation: good specs become the training configs; every bad one names its field and status."""

from __future__ import annotations

import json

import pytest
import torch

from k3.model import checkpoint as ckpt
from k3.model.presets import get_preset
from k3.model.tokenizer import ByteTokenizer
from k3.protos.v1 import jobs_pb2
from k3.services.common.errors import FailedPrecondition, InvalidArgument
from k3.services.trainer.spec import SpecLimits, validate

MICRO = {"hidden_size": 32, "num_layers": 2, "dense_intermediate_size": 32, "kda_heads": 2, "kda_head_dim": 8,
         "kda_gate_rank": 8, "mla_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_dim": 8,
         "qk_extra_dim": 4, "v_head_dim": 8, "num_experts": 4, "top_k": 2, "latent_size": 16,
         "expert_intermediate_size": 16}


def spec(kind: str = "pretrain", preset: str = "tiny", checkpoint: str = "", name: str = "", **body) -> jobs_pb2.JobSpec:
    return jobs_pb2.JobSpec(kind=kind, preset=preset, checkpoint=checkpoint, name=name,
                            spec_json=json.dumps(body) if body else "")


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
    from k3.model.config import K3Config
    from k3.model.muon import PerHeadMuon
    from k3.model.transformer import K3Model

    torch.manual_seed(0)
    cfg = K3Config.from_dict({**get_preset("tiny").to_dict(), **MICRO})
    model = K3Model(cfg)
    run = tmp_path_factory.mktemp("base")
    ckpt.save_checkpoint(run, 3, model=model, optimizer=PerHeadMuon(model.optimizer_groups()), model_config=cfg,
                         tokenizer=ByteTokenizer(), trainer_state={})
    return run


def test_pretrain_spec_maps_onto_the_train_config():
    got = validate(spec(name="demo", steps=12, seed=3, batch_tokens=256, stages=[[0.5, 64], [0.5, 128]],
                        optimizer={"lr": 0.01, "warmup_steps": 2}, data={"max_bytes": 100000}, save_every=4))
    assert got.kind == "pretrain" and got.name == "demo" and got.steps == 12
    p = got.params
    assert (p["preset"], p["steps"], p["seed"], p["lr"], p["warmup_steps"]) == ("tiny", 12, 3, 0.01, 2)
    assert p["stages"] == [[0.5, 64], [0.5, 128]] and p["corpus_max_bytes"] == 100000 and p["save_every"] == 4
    # Fields the trainer owns never come from a spec; threads defaults to the per-job CPUs.
    assert not {"out_dir", "resume", "progress", "cache_dir"} & set(p)
    assert p["threads"] == 1 and validate(spec(), limits=SpecLimits(default_threads=3)).params["threads"] == 3
    assert validate(spec(kind=" pretrain ")).name == "pretrain"


def test_sft_spec_needs_a_readable_checkpoint(base_checkpoint):
    got = validate(spec("sft", preset="", checkpoint=str(base_checkpoint), steps=5, data={"mix": "reasoning=1"},
                        optimizer={"lr": 0.001}))
    assert got.checkpoint == str((base_checkpoint / "checkpoint-3").resolve())
    assert got.params["mix"] == {"reasoning": 1.0, "tools": 0.0} and got.params["lr"] == 0.001
    assert got.steps == 5


def test_job_references_resolve_through_the_trainer(base_checkpoint):
    def resolve(job_id):
        if job_id == "done":
            return "SUCCEEDED", base_checkpoint
        if job_id == "busy":
            return "RUNNING", base_checkpoint
        raise InvalidArgument("checkpoint", f"no job with id {job_id!r}", reason="UNKNOWN_JOB")

    got = validate(spec("sft", preset="", checkpoint="job:done"), resolve_job=resolve)
    assert got.checkpoint.endswith("checkpoint-3")
    with pytest.raises(FailedPrecondition, match="job busy is RUNNING; only a SUCCEEDED") as info:
        validate(spec("sft", preset="", checkpoint="job:busy"), resolve_job=resolve)
    assert info.value.field == "checkpoint"
    with pytest.raises(InvalidArgument, match="no job with id 'nope'"):
        validate(spec("sft", preset="", checkpoint="job:nope"), resolve_job=resolve)


BAD_SPECS = [
    # (spec, field, reason, message fragment)
    (spec(kind="finetune"), "kind", "UNKNOWN_KIND", "unknown job kind 'finetune'"),
    (spec(kind=""), "kind", "UNKNOWN_KIND", "expected one of pretrain, sft, rl"),
    (spec(name="x" * 200), "name", "TOO_LONG", "the limit is 128"),
    (spec(name="a\nb"), "name", "BAD_CHARACTERS", "control characters"),
    (jobs_pb2.JobSpec(kind="pretrain", preset="tiny", spec_json="{steps: 3"), "spec_json", "BAD_JSON",
     "is not valid JSON"),
    (jobs_pb2.JobSpec(kind="pretrain", preset="tiny", spec_json="[1, 2]"), "spec_json", "BAD_JSON",
     "must be a JSON object, got list"),
    (jobs_pb2.JobSpec(kind="pretrain", preset="tiny", spec_json='{"steps": NaN}'), "spec_json", "BAD_JSON",
     "NaN"),
    (jobs_pb2.JobSpec(kind="pretrain", preset="tiny", spec_json=" " * 70000 + "{}"), "spec_json", "TOO_LARGE",
     "the limit is 65536"),
    (spec(preset=""), "preset", "MISSING_FIELD", "required for a pretrain job"),
    (spec(preset="huge"), "preset", "UNKNOWN_PRESET", "unknown preset 'huge'"),
    (spec(preset="kimi-k3"), "preset", "TOO_LARGE", "accepts at most 2,000,000,000"),
    (spec(checkpoint="/somewhere"), "checkpoint", "BAD_CHECKPOINT", "neither a checkpoint"),
    (spec(stepz=3), "spec_json.stepz", "UNKNOWN_FIELD", "is not a pretrain job field"),
    (spec(out_dir="/etc"), "spec_json.out_dir", "UNKNOWN_FIELD", "is not a pretrain job field"),
    (spec(steps=0), "spec_json.steps", "BAD_VALUE", "must be a positive integer, got 0"),
    (spec(steps="ten"), "spec_json.steps", "BAD_VALUE", "must be a positive integer, got 'ten'"),
    (spec(steps=True), "spec_json.steps", "BAD_VALUE", "must be a positive integer, got True"),
    (spec(batch_tokens=-5), "spec_json.batch_tokens", "BAD_VALUE", "must be a positive integer"),
    (spec(seed=-1), "spec_json.seed", "BAD_VALUE", "non-negative integer"),
    (spec(optimizer={"lr": 0}), "spec_json.optimizer.lr", "BAD_VALUE", "must be positive"),
    (spec(optimizer={"lr": -0.1}), "spec_json.optimizer.lr", "BAD_VALUE", "finite number >= 0"),
    (spec(optimizer={"momentum": 0.9}), "spec_json.optimizer.momentum", "UNKNOWN_FIELD",
     "known in optimizer: adamw_lr, grad_clip, lr"),
    (spec(optimizer=0.1), "spec_json.optimizer", "BAD_TYPE", "must be an object, got float"),
    (spec(optimizer={"min_lr_ratio": 2}), "spec_json.optimizer.min_lr_ratio", "BAD_VALUE", "in [0, 1]"),
    (spec(steps=10, optimizer={"warmup_steps": 11}), "spec_json.optimizer.warmup_steps", "BAD_VALUE",
     "integer in [0, steps=10]"),
    (spec(stages=[[0.5, 128], [0.4, 256]]), "spec_json.stages", "BAD_VALUE", "fractions summing to 1"),
    (spec(stages=[[0.5, 256], [0.5, 128]]), "spec_json.stages", "BAD_VALUE", "non-decreasing seq_len"),
    (spec(stages="short"), "spec_json.stages", "BAD_VALUE", "list of [fraction, seq_len] pairs"),
    (spec(stages=[[1.0, 1 << 20]]), "spec_json.stages", "BAD_VALUE", "beyond the model's max_seq_len"),
    (spec(model_overrides={"hidden_size": -3}), "spec_json.model_overrides", "BAD_VALUE", "hidden_size"),
    (spec(model_overrides={"wings": 2}), "spec_json.model_overrides", "BAD_VALUE", "unknown field(s) wings"),
    (spec(data={"corpus": "/x"}), "spec_json.data.corpus", "UNKNOWN_FIELD", "known in data: corpus_root"),
    (spec(data={"eval_fraction": 1.5}), "spec_json.data.eval_fraction", "BAD_VALUE", "in (0, 1)"),
    (spec(threads=0), "spec_json.threads", "BAD_VALUE", "None or a positive integer"),
    (spec("sft", preset=""), "checkpoint", "MISSING_FIELD", "required for an sft job"),
    (spec("sft", preset="tiny"), "preset", "UNEXPECTED_FIELD", "leave preset empty"),
    (spec("sft", preset="", checkpoint="/nope"), "checkpoint", "BAD_CHECKPOINT", "neither a checkpoint"),
]


@pytest.mark.parametrize(("bad", "field", "reason", "fragment"), BAD_SPECS,
                         ids=[f"{i}-{case[1]}" for i, case in enumerate(BAD_SPECS)])
def test_bad_specs_are_invalid_arguments_naming_the_field(bad, field, reason, fragment):
    with pytest.raises(InvalidArgument) as info:
        validate(bad)
    assert (info.value.field, info.value.reason) == (field, reason)
    assert fragment in info.value.message


def test_bad_sft_fields_name_the_spec_path(base_checkpoint):
    cases = [({"data": {"mix": "poetry=1"}}, "spec_json.data.mix", "unknown kind 'poetry'"),
             ({"eval_conversations": 0}, "spec_json.eval_conversations", "positive integer"),
             ({"stages": [[1.0, 64]]}, "spec_json.stages", "is not a sft job field"),
             ({"optimizer": {"grad_clip": -1}}, "spec_json.optimizer.grad_clip", "finite number >= 0")]
    for body, field, fragment in cases:
        with pytest.raises(InvalidArgument) as info:
            validate(spec("sft", preset="", checkpoint=str(base_checkpoint), **body))
        assert info.value.field == field and fragment in info.value.message, (body, info.value)
    # A folder that is not a k3 checkpoint at all.
    not_a_checkpoint = base_checkpoint / "checkpoint-3" / "tokenizer"
    with pytest.raises(InvalidArgument) as info:
        validate(spec("sft", preset="", checkpoint=str(not_a_checkpoint)))
    assert info.value.field == "checkpoint"


def test_rl_jobs_without_the_rl_module_are_a_failed_precondition():
    with pytest.raises(FailedPrecondition, match="RL jobs need k3.services.trainer.rl_job") as info:
        validate(spec("rl"), rl_available=None)
    assert info.value.field == "kind"


def test_rl_specs_are_validated_by_the_rl_job_config():
    rl_job = pytest.importorskip("k3.services.trainer.rl_job")
    got = validate(spec("rl", steps=3, environments=["reasoning_gym/chain_sum"], max_staleness=2,
                        efforts=["low", "high"]), rl_available=lambda: rl_job)
    assert got.kind == "rl" and got.steps == 3
    assert (got.params["preset"], got.params["max_staleness"], got.params["efforts"]) == ("tiny", 2, ["low", "high"])
    cases = [(spec("rl", environments=["chess"]), "spec_json.environments", "UNKNOWN_ENVIRONMENT"),
             (spec("rl", max_staleness=-1), "spec_json.max_staleness", "BAD_VALUE"),
             (spec("rl", efforts=["extreme"]), "spec_json.efforts", "BAD_VALUE"),
             (spec("rl", wings=1), "spec_json.wings", "UNKNOWN_FIELD"),
             (spec("rl", bus_url="kafka://x:1"), "spec_json.bus_url", "UNEXPECTED_FIELD"),
             (spec("rl", preset="kimi-k3"), "preset", "BAD_VALUE"),
             (spec("rl", preset=""), "preset", "MISSING_FIELD")]
    for bad, field, reason in cases:
        with pytest.raises(InvalidArgument) as info:
            validate(bad, rl_available=lambda: rl_job)
        assert (info.value.field, info.value.reason) == (field, reason), info.value
