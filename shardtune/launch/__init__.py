"""Multi-node launch: torchrun / SLURM / Kubernetes renderers, network presets, `doctor`.

`spec.LaunchSpec` holds the validated options; `torchrun.render_torchrun`, `slurm.render_slurm`
and `k8s.render_k8s` turn it into text; `network.preset` gives the NCCL/gloo environment per
interconnect; `advice.comm_bound_warning` says when a strategy is communication-bound there.
"""
