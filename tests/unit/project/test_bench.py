"""The benchmarks (benchmarks/runner.py, benchmarks/probes/, scripts/bench*.py): every probe module imports, says what
it measures and parses its arguments; scripts/bench.py still takes the commands the docs quote and picks the same
probes; the report's format; and the cheapest probe end to end, into a temporary results file (never the real one)."""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO, clean_env

sys.path.insert(0, str(REPO / "scripts"))
import bench  # noqa: E402  (scripts/bench.py)

from benchmarks import probes, runner  # noqa: E402
from benchmarks.probes import side_by_side  # noqa: E402

PROBES = [importlib.import_module(f"benchmarks.probes.{m.name}") for m in pkgutil.iter_modules(probes.__path__)]
HEADING = re.compile(r"^## \d{4}-\d\d-\d\d \d\d:\d\d UTC — \S+, \d+ CPU cores, Python [\d.]+, torch \S+$")


@pytest.mark.parametrize("probe", PROBES, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_each_probe_imports_says_what_it_measured_and_parses_its_help(probe, capsys):
    assert re.search(r"^Memory-model constants", probe.__doc__, re.M), "the docstring names its constants (or none)"
    assert callable(probe.run) and callable(probe.add_arguments)
    with pytest.raises(SystemExit) as stop:
        runner.main(probe, ["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "--out" in out and "--no-append" in out and probe.__doc__.split()[0] in out
    assert ("--child" in out) is False  # internal: a probe's fresh process, not a user's flag


def test_the_probes_are_all_reachable_from_a_script():
    """Every probe runs under some command of scripts/bench.py, bench_accelerator.py or bench_bucket.py."""
    fronted = {p.__name__ for p in bench.PROBES} | {"benchmarks.probes.accelerator", "benchmarks.probes.bucket",
                                                     "benchmarks.probes.side_by_side"}
    fronted |= {"benchmarks.probes.xla_checkpointing"}  # in --checkpointing
    assert {p.__name__ for p in PROBES} == fronted


def quoted_commands() -> set[str]:
    """The `python scripts/bench.py ...` commands quoted in the README, docs/, benchmarks/RESULTS.md and its
    docstring: each still has to parse."""
    texts = [REPO / "README.md", REPO / "benchmarks" / "RESULTS.md", *sorted((REPO / "docs").glob("*.md"))]
    found = {m.group(1).strip() for t in texts for m in re.finditer(r"python scripts/bench\.py([^`\n]*)`",
                                                                        t.read_text())}
    found |= {m.group(1).split("#")[0].strip() for m in re.finditer(r"python scripts/bench\.py(.*)", bench.__doc__)}
    return found


def test_the_commands_the_docs_quote_still_parse():
    commands = quoted_commands()
    assert {"", "--checkpointing", "--sd3-activations --precisions float32", "--lazy-checkpointing",
            "--host-overhead --variants --ks 2 --checkpointed"} <= commands
    for command in commands:
        assert bench.selected(bench.parse(command.split())), command


@pytest.mark.parametrize("command, expected", [
    ("", ["training_runs", "pipeline"]),
    ("--no-pipeline --backends eager_cpu", ["training_runs"]),
    ("--host-overhead", ["host_overhead", "step_estimate"]),
    ("--host-overhead --no-estimate --variants eager_k1", ["host_overhead"]),
    ("--full-width --backends cpu --overrides train.mixed_precision=bf16", ["full_width"]),
    ("--sd3-activations --precisions float32", ["sd3_activations"]),
    ("--checkpointing", ["checkpointing"]),
    ("--lazy-checkpointing", ["lazy_checkpointing"]),
    ("--sd3-parameters", ["sd3_parameters"]),
    ("--sd14-activations --batches 1", ["sd14_activations"]),
])
def test_bench_py_runs_the_probes_its_flags_name(command, expected):
    assert [p.__name__.rsplit(".", 1)[1] for p in bench.selected(bench.parse(command.split()))] == expected


def test_bench_py_flags_keep_their_values():
    args = bench.parse("--host-overhead --variants --ks 2 --checkpointed".split())
    assert args.variants == [] and args.ks == [2] and args.checkpointed
    args = bench.parse("--steps 10 --backends eager_cpu cpu --no-pipeline".split())
    assert args.steps == [10] and args.backends == ["eager_cpu", "cpu"] and args.no_pipeline
    with pytest.raises(SystemExit):
        bench.parse(["--backends", "tpu"])  # not a topology the benchmark knows


def test_table_has_a_column_for_every_key_in_first_seen_order():
    text = runner.table([{"a": 1, "b": 2}, {"a": 3, "c": "x"}])
    assert text.splitlines() == ["| a | b | c |", "|---|---|---|", "| 1 | 2 |  |", "| 3 |  | x |"]
    assert runner.table([]) == ""


@pytest.mark.parametrize("load, verdict", [(0.2, "quiet when it started"), (3.5, "busy: ")])
def test_a_report_appends_a_dated_section_with_the_machine_and_its_load(tmp_path, monkeypatch, load, verdict):
    monkeypatch.setattr(runner.os, "getloadavg", lambda: (load, 0.0, 0.0))
    out = tmp_path / "sub" / "RESULTS.md"
    for note in ("", "a test ran beside it"):
        report = runner.Report("python scripts/bench.py --x", out, note)
        report.add("A table:\n\n" + runner.table([{"k": 1}]))
        report.finish()
    text = out.read_text()
    assert text.startswith(runner.RESULTS_HEADER)
    sections = text[len(runner.RESULTS_HEADER):].split("\n## ")[1:]
    assert len(sections) == 2
    for section in sections:
        lines = section.splitlines()
        assert HEADING.match("## " + lines[0]), lines[0]
        assert lines[2] == "`python scripts/bench.py --x`"
        assert "| k |" in lines and "| 1 |" in lines
        assert re.search(rf"Machine load \(1-minute load average, \d+ cores\): {load:.2f} at the start, .*{verdict}",
                         section)
    assert sections[1].rstrip().endswith("Note: a test ran beside it") and "Note:" not in sections[0]


def test_no_append_prints_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "RESULTS.md"
    runner.Report("cmd", None).finish()
    assert not out.exists() and "`cmd`" in capsys.readouterr().out


def table_rows(text: str) -> list[dict]:
    """The rows of the first Markdown table in text, as dicts of strings."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| ") and lines[i + 1].startswith("|---"))
    cells = lambda line: [c.strip() for c in line.strip()[1:-1].split("|")]
    cols, rows = cells(lines[start]), []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(cols, cells(line))))
    return rows


def test_the_cheapest_probe_through_bench_py_into_a_results_file(tmp_path, capsys):
    """scripts/bench.py --sd3-parameters (SD 3.5 Medium built on the meta device: seconds) writes a section to the
    given file (never the real one) whose figures are the memory model's SD35_MEDIUM_BILLIONS."""
    from ddpo_tpu.catalog.families import SD35_MEDIUM_BILLIONS

    out = tmp_path / "RESULTS.md"
    bench.main(["--sd3-parameters", "--out", str(out)])
    text = out.read_text()
    assert text.startswith(runner.RESULTS_HEADER) and text.count("\n## ") == 1
    assert HEADING.match("## " + text.split("\n## ")[1].splitlines()[0])
    assert f"`python scripts/bench.py --sd3-parameters --out {out}`" in text
    (row,) = table_rows(text)
    got = {k: float(v) for k, v in row.items()}
    assert got["clip_l"] + got["clip_g"] == pytest.approx(SD35_MEDIUM_BILLIONS["clips"], abs=1.5e-3)
    for part in ("transformer", "pos_embed", "t5", "vae"):  # both rounded to 3 decimals (pos_embed 0.2265)
        assert got[part] == pytest.approx(SD35_MEDIUM_BILLIONS[part], abs=1.5e-3), part
    assert text[len(runner.RESULTS_HEADER):] in capsys.readouterr().out  # printed as appended


@pytest.mark.slow
@pytest.mark.xla
def test_the_cheapest_child_probe_end_to_end(tmp_path):
    """scripts/bench.py --lazy-checkpointing on the 4-attention-block model only: two probes, each in a fresh
    process of its own (`python -m benchmarks.probes.lazy_checkpointing --child ...`) on XLA CPU; the section lands in
    the given results file with the rows the graphs imply (one barrier per checkpointed block before optimisation)."""
    out = tmp_path / "RESULTS.md"
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--lazy-checkpointing", "--models", "blocks",
                           "--out", str(out)], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = out.read_text()
    assert text.startswith(runner.RESULTS_HEADER) and text.count("\n## ") == 1
    assert "`python scripts/bench.py --lazy-checkpointing --models blocks --out " in text
    rows = table_rows(text)
    assert [(r["model"], r["checkpointed"], r["barriers_before_opt"]) for r in rows] == [
        ("blocks", "False", "0"), ("blocks", "True", "4")]
    assert "Machine load" in text


def test_the_derived_attention_scores_are_the_memory_models():
    """The softmaxes XLA keeps, as the probes derive them (SD 1.4: token counts read off a meta-device forward of
    the UNet), are the figures the HBM rule adds."""
    from ddpo_tpu.catalog.families import SD1_ATTENTION_SCORES_GIB_512, SD3_ATTENTION_SCORES_GIB_512

    from benchmarks.probes import sd3_activations, sd14_activations

    assert sd14_activations.attention_scores_gib() == pytest.approx(SD1_ATTENTION_SCORES_GIB_512, abs=0.05)
    assert sd3_activations.attention_scores_gib() == pytest.approx(SD3_ATTENTION_SCORES_GIB_512, rel=1e-9)


# ------------------------------------------------------------------------------------------ the side-by-side bench
# The references' phase bars, as their train scripts name them: kvablack/ddpo-pytorch@1958463 scripts/train.py:312
# "Epoch {epoch}: sampling", :378 "Waiting for rewards", :489 "Epoch {epoch}.{inner_epoch}: training", :503
# "Timestep"; yifan123/flow_grpo@ac4c86e scripts/train_sd3.py:229 "Eval: ", :614, :687, :848 the same three, and
# :600 `while True` (no epoch count). A stand-in script with that structure, a sleep for each phase's work:
STAND_IN = """
import imp, sys, time            # both references' config files import imp (gone in Python 3.12)
from functools import partial
import tqdm
tqdm = partial(tqdm.tqdm, dynamic_ncols=True)   # bound at import, as both scripts do
for _ in tqdm(range(1), desc="Eval: "):
    time.sleep(0.2)
epoch = 0
while True:
    for _ in tqdm(range(2), desc=f"Epoch {epoch}: sampling"):
        time.sleep(0.2 if epoch == 0 else 0.1)  # the first epoch warms up
    for _ in tqdm(range(2), desc="Waiting for rewards"):
        pass
    for _ in tqdm(range(1), desc=f"Epoch {epoch}.0: training"):
        for _ in tqdm(range(3), desc="Timestep"):
            time.sleep(0.1)
    epoch += 1
"""


def test_the_harness_times_an_unmodified_scripts_bars_and_stops_it_after_n_epochs(tmp_path):
    script = tmp_path / "scripts" / "train.py"
    script.parent.mkdir()
    script.write_text(STAND_IN)
    out = tmp_path / "h.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "reference_harness.py"), "--json", str(out),
                           "--stop-after", "2", "--", "scripts/train.py"], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["outcome"] == "stopped before epoch 2"
    descs = [p["desc"] for p in record["phases"]]
    assert descs == ["Eval: "] + ["Epoch 0: sampling", "Waiting for rewards", "Epoch 0.0: training",
                                  "Epoch 1: sampling", "Waiting for rewards", "Epoch 1.0: training"]
    m = side_by_side.phases_to_measure(record, epochs=2)
    # each bar holds its own sleeps (the harness's stamps are rounded to 1 ms) and not the other phase's, which would
    # make it 0.5 s or more: the upper bounds leave a busy machine 0.2-0.3 s of late wake-ups (0.05 s seen at load 10)
    assert 0.2 - 2e-3 <= m["sampling_s"] < 0.5 and 0.3 - 2e-3 <= m["training_s"] < 0.5
    assert m["epoch_s"] >= m["sampling_s"] + m["training_s"] - 1e-3
    assert m["warmup_s"] == pytest.approx(0.2, abs=0.15)  # epoch 0 sampled 0.2 s longer
    # load_s and eval_s are rounded to 0.1 s: a 0.05 s tolerance is the rounding's alone (CI once measured the old
    # 0.05 s eval as 5.421 - 5.371 = 0.04999..., rounded to 0.0), so the eval sleeps 0.2 s and both allow 0.06
    assert m["load_s"] == pytest.approx(record["phases"][0]["start"], abs=0.06)
    assert 0.15 <= m["eval_s"] < 0.5  # slept 0.2 s; late wake-ups only lengthen it
    assert record["device"] == "cpu" and record["versions"]["torch"]


def measured(sampling_s, training_s, epoch_s, **more):
    return {"sampling_s": sampling_s, "training_s": training_s, "epoch_s": epoch_s, **more}


def test_a_rows_rates_and_mfu_follow_from_the_shape_and_the_seconds():
    """SD 1.4 at the full size's shape: 16 samples of 20 steps; sampling = 16 x (20 x 2 x 0.80 + 2.51) TFLOP,
    training = 16 x 20 x 2 x 3 x 0.80 (benchmarks/probes/accelerator.py's figures), on a 989 TFLOP/s device."""
    s = side_by_side.SIZES["full"]["sd14"]
    sampling_tf, training_tf = 16 * (20 * 2 * 0.80 + 2.51), 16 * 20 * 2 * 3 * 0.80
    assert side_by_side.epoch_tflop("sd14", s) == pytest.approx((sampling_tf, training_tf))
    r = side_by_side.row("sd14", "ddpo_tpu", s, measured(4.0, 8.0, 12.5, peak_gib=20.5), 989.0)
    assert (r["samples/epoch"], r["sampling img/s"], r["training img/s"], r["epoch img/s"]) == (16, 4.0, 2.0, 1.28)
    assert r["MFU epoch %"] == pytest.approx(100 * (sampling_tf + training_tf) / (12.5 * 989), abs=0.01)
    assert r["MFU training %"] == pytest.approx(100 * training_tf / (8.0 * 989), abs=0.01)
    assert r["peak GiB"] == 20.5
    # SD 3.5: int(10 x 0.99) = 9 trained timesteps of 10 (flow_grpo's timestep_fraction)
    s35 = side_by_side.SIZES["full"]["sd35"]
    assert side_by_side.epoch_tflop("sd35", s35)[1] == pytest.approx(18 * 9 * 2 * 3 * 6.08)


def test_ratios_are_ddpo_tpu_over_the_reference_per_pair_and_a_missing_side_gives_none():
    s = side_by_side.SIZES["tiny"]["sd14"]
    rows = [side_by_side.row("sd14", "ddpo_tpu", s, measured(1.0, 2.0, 3.2), 1.0),
            side_by_side.row("sd14", "ddpo-pytorch", s, measured(2.0, 5.0, 8.0), 1.0),
            {"pair": "sd35", "side": "ddpo_tpu", "failed": "exit 1"},
            side_by_side.row("sd35", "flow_grpo", side_by_side.SIZES["tiny"]["sd35"], measured(1, 1, 2), 1.0)]
    (ratio,) = side_by_side.ratios(rows)
    assert ratio == {"pair": "sd14", "ddpo_tpu / reference": "ddpo-pytorch", "sampling img/s": 2.0,
                     "training img/s": 2.5, "epoch img/s": 2.5}
    text = runner.table(rows)  # a failed side is a row with its reason, beside the measured ones
    assert "exit 1" in text and text.count("\n") == len(rows) + 1


def test_both_sides_get_the_same_shape_and_the_same_checkpoint(tmp_path):
    """The ddpo_tpu overrides and the reference's flags name the same batch sizes, batches, steps and directory."""
    model = tmp_path / "sd35-reference"
    prompts = tmp_path / "train.txt"
    for pair in ("sd14", "sd35"):
        s = side_by_side.SIZES["full"][pair]
        ours = side_by_side.ddpo_tpu_overrides(pair, s, model, "gpu-1", 2, prompts)
        ref = side_by_side.reference_argv(pair, s, model, 2, True, tmp_path, prompts)
        assert f"sample.batch_size={s['batch']}" in ours and f"train.batch_size={s['train_batch']}" in ours
        assert f"sample.num_batches_per_epoch={s['batches']}" in ours and f"sample.num_steps={s['steps']}" in ours
        assert f"--config.sample.num_batches_per_epoch={s['batches']}" in ref
        assert f"--config.sample.num_steps={s['steps']}" in ref and f"--config.pretrained.model={model}" in ref
        assert "train.mixed_precision=bf16" in ours and not any("mixed_precision" in a for a in ref)  # fp16 there
    # flow_grpo's per-device batch sizes and the single-GPU KL choice, both sides
    assert {"--config.sample.train_batch_size=9", "--config.train.batch_size=9", "--config.train.beta=0"} <= set(ref)
    assert {f"model.pretrained={model}", "algorithm.kl_beta=0", "algorithm.group_size=9"} <= set(ours)
    # on a CPU accelerate refuses fp16: the reference computes in float32 there
    assert "--config.mixed_precision=no" in side_by_side.reference_argv("sd14", s, model, 2, False, tmp_path, prompts)


def test_the_sd35_checkpoint_has_sd35_mediums_shapes_but_the_embedding_tables():
    """benchmarks/checkpoints.py's parts on the meta device against the checkpoint's counts (sd3_parameters):
    equal but for the smaller token tables (514 CLIP tokens for 49,408, 98 T5 tokens for 32,128)."""
    import torch

    from benchmarks.checkpoints import sd35_medium_parts
    from benchmarks.probes.sd3_parameters import billions

    parts = sd35_medium_parts("meta", 514, 98, {"bos": 512, "eos": 513, "pad_2": 1})
    count = {k: sum(p.numel() for p in m.parameters()) for k, m in parts.items()}
    real = billions()
    assert count["transformer"] / 1e9 == pytest.approx(real["transformer"], abs=1e-3)
    assert count["vae"] / 1e9 == pytest.approx(real["vae"], abs=1e-3)
    assert (count["text_encoder_3"] + (32128 - 98) * 4096) / 1e9 == pytest.approx(real["t5"], abs=1e-3)
    clips = count["text_encoder"] + count["text_encoder_2"] + (49408 - 514) * (768 + 1280)
    assert clips / 1e9 == pytest.approx(real["clip_l"] + real["clip_g"], abs=2e-3)
    assert all(p.device == torch.device("meta") for m in parts.values() for p in m.parameters())


def test_the_trajectory_gather_bytes_by_hand():
    """benchmarks/gather_bytes.py, per sample: SD 1.4's 51 float32 latents of 4 x 64 x 64 and its (77, 768) text
    embeddings; SD 3.5 Medium's 11 bfloat16 latents of 16 x 64 x 64, (205, 4096) embeddings and (2048,) pooled;
    Wan's 21 bfloat16 latents of 16 channels x (81 - 1) / 4 + 1 = 21 latent frames x 480 / 8 x 832 / 8 and UMT5's
    (512, 4096). Kept on their rank: 1/8 of the epoch held, only the float64 rewards received."""
    from benchmarks import gather_bytes

    sd14, sd35, _, wan = gather_bytes.SHAPES
    assert gather_bytes.per_sample_bytes(wan)["latents"] == 21 * 16 * 21 * 60 * 104 * 2
    assert gather_bytes.per_sample_bytes(wan)["conditioning"] == 512 * 4096 * 2
    wan_row = gather_bytes.gather_row(wan, 8, ())
    wan_whole = 128 * (21 * 16 * 21 * 60 * 104 * 2 + 20 * 12 + 512 * 4096 * 2)
    assert wan_row["GiB held per rank"] == round(wan_whole / 2 ** 30, 2)
    assert wan_row["kept on rank: GiB held per rank"] == round(wan_whole / 8 / 2 ** 30, 2)
    assert wan_row["kept on rank: KiB received per rank"] == round(128 * 8 * 7 / 8 / 1024, 2)
    assert gather_bytes.per_sample_bytes(sd14) == {"latents": 51 * 4 * 64 * 64 * 4, "log_probs": 200,
                                                   "step_indices": 400, "conditioning": 77 * 768 * 4}
    assert gather_bytes.per_sample_bytes(sd35)["latents"] == 11 * 16 * 64 * 64 * 2
    assert gather_bytes.per_sample_bytes(sd35)["conditioning"] == (205 * 4096 + 2048) * 2
    row = gather_bytes.gather_row(sd14, 8, (12.5,))
    whole = 256 * (51 * 4 * 64 * 64 * 4 + 600 + 77 * 768 * 4)
    assert row["GiB held per rank"] == round(whole / 2 ** 30, 2)
    assert row["GiB received per rank (8 ranks)"] == round(whole * 7 / 8 / 2 ** 30, 2)


def test_the_sd35_builder_saves_a_checkpoint_both_loaders_read(tmp_path, monkeypatch):
    """build_sd35_medium end to end at toy widths (its config dicts shrunk): a diffusers directory that ddpo_tpu's
    load_sd3 reads with its T5, and whose reference view names tokenizer_3 T5TokenizerFast (as SD 3.5 Medium's
    model_index.json does) while the view's parts are the built ones."""
    from benchmarks import checkpoints
    from benchmarks.probes import sd3_activations, sd3_parameters
    from ddpo_tpu.models.sd3 import load_sd3

    monkeypatch.setattr(sd3_activations, "SD35_MEDIUM_TRANSFORMER", dict(
        sample_size=8, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=48, out_channels=16,
        pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm"))
    small = dict(intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77)
    monkeypatch.setattr(sd3_parameters, "CLIP_L", dict(small, hidden_size=16, projection_dim=16))
    monkeypatch.setattr(sd3_parameters, "CLIP_G", dict(small, hidden_size=32, projection_dim=32))
    monkeypatch.setattr(sd3_parameters, "T5_XXL", dict(d_model=32, d_ff=64, d_kv=16, num_heads=2, num_layers=1,
                                                       feed_forward_proj="gated-gelu"))
    monkeypatch.setattr(sd3_parameters, "VAE", dict(sd3_parameters.VAE, block_out_channels=(32, 32),
                                                    down_block_types=("DownEncoderBlock2D",) * 2,
                                                    up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1))
    out = checkpoints.build_sd35_medium(tmp_path / "sd35", device="cpu")
    comps = load_sd3(str(out), local_files_only=True, load_t5=True)
    assert comps.text_encoder_3 is not None and comps.transformer.config.num_layers == 2
    assert next(comps.transformer.parameters()).dtype.is_floating_point
    view = checkpoints.reference_view(out)
    index = json.loads((view / "model_index.json").read_text())
    assert index["tokenizer_3"] == ["transformers", "T5TokenizerFast"]
    assert (view / "transformer").resolve() == (out / "transformer").resolve()


def harness_record(epoch_seconds):
    """A reference harness record whose epoch n samples for s/2 and trains for s/2 (s = epoch_seconds[n])."""
    phases, t = [], 1.0
    for n, s in enumerate(epoch_seconds):
        phases += [{"desc": f"Epoch {n}: sampling", "start": t, "end": t + s / 2},
                   {"desc": f"Epoch {n}.0: training", "start": t + s / 2, "end": t + s}]
        t += s
    return {"phases": phases, "outcome": "stopped"}


def test_the_measured_epoch_is_the_median_of_those_after_the_first_on_both_sides():
    """One epoch slowed by other work on the cores (10 s among 0.3-0.4 s) is not the figure, nor is epoch 0's
    warm-up; with two epochs the measured one is the last, as before."""
    m = side_by_side.phases_to_measure(harness_record([5.0, 10.0, 0.3, 0.4]), epochs=4)
    assert m["epoch_s"] == pytest.approx(0.4) and m["sampling_s"] == pytest.approx(0.2)
    assert m["warmup_s"] == pytest.approx(4.6)
    assert side_by_side.phases_to_measure(harness_record([5.0, 10.0]), epochs=2)["epoch_s"] == pytest.approx(10.0)

    def ddpo_epoch(sampling, training):
        secs = {"sampling": sampling, "reward": 0.01, "advantages": 0.01, "training": training}
        return {"phases": {k: {"seconds": v} for k, v in secs.items()}}

    m = side_by_side.ddpo_tpu_phases([ddpo_epoch(4.0, 1.0), ddpo_epoch(9.0, 1.0), ddpo_epoch(0.2, 0.1),
                                      ddpo_epoch(0.3, 0.1)])
    assert (m["sampling_s"], m["training_s"]) == (0.3, 0.1) and m["epoch_s"] == pytest.approx(0.42)
    assert m["warmup_s"] == pytest.approx(4.6) and m["all_s"] == pytest.approx(5.02 + 10.02 + 0.32 + 0.42)


def test_on_a_cpu_both_sides_get_the_same_thread_count():
    """A CPU topology pins OMP/MKL threads to 1 for both sides (or --threads); a GPU keeps torch's default."""
    import argparse

    ap = argparse.ArgumentParser()
    side_by_side.add_arguments(ap)
    assert side_by_side.cpu_threads(ap.parse_args(["--topology", "eager_cpu"])) == 1
    assert side_by_side.cpu_threads(ap.parse_args(["--topology", "gpu-1"])) is None
    assert side_by_side.cpu_threads(ap.parse_args(["--topology", "eager_cpu", "--threads", "2"])) == 2
    env = side_by_side.side_env(2, WANDB_MODE="disabled")
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"], env["WANDB_MODE"]) == ("2", "2", "disabled")
    assert side_by_side.side_env(None) == runner.clean_env()
