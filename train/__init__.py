"""Training EAGLE draft heads: `eagle train` (loop.train) and `eagle plan` (plan.make_plan).

Modules, in the order a run uses them:
- config.py       TrainConfig, the schema of the YAML presets and the overrides, and its one-line checks.
- plan.py         what a run needs (features on the disk, memory per process) before it runs; the refusals.
- precision.py    the run's dtypes (target, head master weights, products, saved head) and the optimizer.
- data.py         rows, batches and the DataLoader that collates them ahead of the step.
- features.py     the target features: cached beside the rows, the feature pass shared by every process.
- losses.py       the draft losses and the training-time test (the head unrolled on its own outputs).
- validate.py     chain decoding simulated along held-out rows, and real decoding of a few prompts.
- checkpoints.py  TrainState, checkpoints written whole, resume.
- parallel.py     several processes: gradients averaged, one writer.
- runlog.py       log.jsonl and TensorBoard.
- loop.py         `train`: the steps, from the config to the best head in `out`.

This package may import eagle, data_prep and infer.
"""
