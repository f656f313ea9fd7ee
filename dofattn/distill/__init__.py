"""Distillation of the linear student from its softmax teacher, one module per stage:

    choose.py       features per layer (the DoF allocation) and the layers that keep softmax attention
    teacher.py      the teacher's q/k/v on the training blocks, one file per layer
    losses.py       the layerwise losses (softmax rows, kernel values)
    layerwise.py    each layer's feature map trained alone against the teacher
    end_to_end.py   the whole student against the teacher, checkpointed
    run_folder.py   what a run folder records, resuming, --continue-from, reading a run back (`RunFolder`)
    run.py          the job: `run(recipe, out, device)`
    plan.py         what a run will do and need, from the config alone (`dofattn distill --dry-run`)

`dofattn distill` is `run.run`; `torchrun --nproc_per_node N -m dofattn distill ...` splits the layerwise stage's layers
over the processes and shards the end-to-end phase's model over them (FSDP2). A run killed at any point and started
again with the same command ends with the same weights: layer l trains from a generator seeded by (seed, l),
end-to-end step i on blocks drawn from (seed, i).
"""
