"""Where a base's replicas may run, as Ray Serve is told: a CUDA engine only where a GPU is, per-base GPUs, custom
resources and a cap per node; `manyfold serve --ray-address` joins a cluster rather than starting Ray."""

import argparse

from serve.app import replica_options
from serve.cli.server import _serve_config
from serve.config import parse_config


def test_a_cuda_base_reserves_a_gpu_and_per_base_settings_reach_ray():
    config = parse_config({"store": "/s", "device": "cuda",
                           "deployments": {"enc": {"num_gpus": 0.25, "resources": {"a100": 1},
                                                   "max_replicas_per_node": 1}}})
    lm, _ = replica_options(config, "lm", 2.0)
    enc, _ = replica_options(config, "enc", 2.0)
    assert lm["ray_actor_options"]["num_gpus"] == 1.0 and "max_replicas_per_node" not in lm
    assert enc["ray_actor_options"]["num_gpus"] == 0.25 and enc["ray_actor_options"]["resources"] == {"a100": 1}
    assert enc["max_replicas_per_node"] == 1
    cpu, threads = replica_options(parse_config({"store": "/s"}), "lm", 1.5)
    assert cpu["ray_actor_options"]["num_gpus"] == 0.0 and threads == 2
    encoder_on_cpu = parse_config({"store": "/s", "device": "cuda", "deployments": {"enc": {"device": "cpu"}}})
    assert replica_options(encoder_on_cpu, "enc", 2.0)[0]["ray_actor_options"]["num_gpus"] == 0.0
    assert replica_options(encoder_on_cpu, "lm", 2.0)[0]["ray_actor_options"]["num_gpus"] == 1.0


def test_ray_address_from_the_command_line_reaches_the_config(tmp_path):
    args = argparse.Namespace(store=str(tmp_path), port=None, config=None, ray_address="ray://head:10001")
    assert _serve_config(args, tmp_path).ray_address == "ray://head:10001"
    yaml_config = tmp_path / "serve.yaml"
    yaml_config.write_text(f"store: {tmp_path}\n")
    args = argparse.Namespace(store=None, port=None, config=str(yaml_config), ray_address="auto")
    assert _serve_config(args, None).ray_address == "auto"
