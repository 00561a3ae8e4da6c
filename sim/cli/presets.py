"""``fsdpsim presets``: the model presets and the built-in hardware profiles."""

import argparse

from sim.hardware.builtin import BUILTIN_PROFILES
from sim.hardware.registry import load_profile
from sim.scenario.hf_model import library
from sim.workload.model import PRESETS, n_params


def main(args: argparse.Namespace) -> int:
    print("model presets:")
    for name, cfg in PRESETS.items():
        print(f"  {name:<12} {n_params(cfg):>16,} params  layers={cfg.n_layers} hidden={cfg.hidden}")
    print("model library (Hugging Face configs: model.preset = NAME or hub id):")
    for name, entry in library().items():
        print(f"  {name:<24} {entry.hub_id:<46} {entry.family}")
    print("built-in hardware profiles (datasheet, not calibrated):")
    for name in BUILTIN_PROFILES:
        print(f"  {name:<12} {load_profile(name).device.name}")
    return 0
