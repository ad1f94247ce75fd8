"""The smoke run with rewards beyond JPEG: the aesthetic reward on tiny local CLIP + MLP, and a weighted sum of JPEG
compressibility and a remote reward served by the reference server on localhost."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from tests.helpers import REPO, clean_env, read_metrics, run_train

pytestmark = pytest.mark.slow

SHORT = ["+experiment=smoke", "num_epochs=1", "sample.num_batches_per_epoch=1"]


# aesthetic extended (~18 s here): CI trains on it in tests/e2e/test_training.py's runs (reward=aesthetic)
@pytest.mark.parametrize("reward", [pytest.param("aesthetic", marks=pytest.mark.extended), "clip_score"])
def test_smoke_with_clip_rewards_on_tiny_local_models(tmp_path, model_cache, reward):
    proc = run_train([*SHORT, f"reward={reward}", f"model.cache_dir={model_cache}"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    epoch = read_metrics(tmp_path / "outputs" / "smoke", "epoch")[0]
    assert math.isfinite(epoch["reward_mean"]) and epoch["reward_std"] > 0


# extended (~40 s here): CI's are tests/unit/rewards/test_remote_reward.py::test_weighted_sum_of_local_and_remote and
# tests/unit/prompts/test_prompt_datasets.py's weighted launcher run (slow tier)
@pytest.mark.extended
def test_smoke_with_a_weighted_sum_of_jpeg_and_a_remote_reward(tmp_path, model_cache):
    server = subprocess.Popen([sys.executable, str(REPO / "scripts" / "reward_server.py"), "--port", "0",
                               "--idle-timeout", "120"], cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        assert line.startswith("listening on 127.0.0.1:"), line
        port = int(line.strip().rsplit(":", 1)[1])
        components = (f"reward.components=[{{name:jpeg_compressibility,weight:0.5}},"
                      f"{{name:remote,weight:2.0,url:'http://127.0.0.1:{port}/score'}}]")
        proc = run_train([*SHORT, "reward=weighted", components, f"model.cache_dir={model_cache}"], tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:]
        weighted = read_metrics(tmp_path / "outputs" / "smoke", "epoch")[0]["reward_mean"]
        plain = run_train([*SHORT, f"model.cache_dir={model_cache}", "run_name=plain"], tmp_path)
        assert plain.returncode == 0
        jpeg = read_metrics(tmp_path / "outputs" / "plain", "epoch")[0]["reward_mean"]
        # the server scores JPEG compressibility too: 0.5 x r + 2.0 x r on the same (seeded) images
        assert math.isclose(weighted, 2.5 * jpeg, rel_tol=1e-5), (weighted, jpeg)
    finally:
        server.terminate()
        server.wait(timeout=30)
