"""An ml_collections config file for yifan123/flow_grpo's scripts/train_sd3.py (passed as --config=THIS:pickscore_sd3,
run from the clone): the reference's own config/grpo.py function of that name, unchanged but for the reward. Its
PickScore reward loads two models from the hub (laion/CLIP-ViT-H-14, yuvalkirstain/PickScore_v1), which the bench
machine cannot reach; JPEG compressibility (flow_grpo's own `jpeg_compressibility`, which its config/grpo.py
`compressibility` uses) takes its place on both sides of the comparison. Every shortening of the epoch is a
--config.* flag on the command line, where the report shows it."""

import importlib.util
import os


def get_config(name):
    path = os.path.join(os.getcwd(), "config", "grpo.py")  # the reference's, from its clone (the working dir)
    spec = importlib.util.spec_from_file_location("flow_grpo_config_grpo", path)
    grpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grpo)
    config = getattr(grpo, name)()
    config.reward_fn = {"jpeg_compressibility": 1.0}
    return config
