"""The jobs the commands run, a module each, every one `run(config, progress=None)` on a config dataclass whose
fields are its command's options (the device options inherited from `options.Machine`):

    dof        `dofattn dof`: each layer's degrees of freedom and the feature dims they give (`DofConfig`)
    eval       `dofattn eval`: a student against its teacher: perplexity, KL, by position, recall (`EvalConfig`)
    generate   `dofattn generate`: a prompt continued, HF generate or the static decoder (`GenerateConfig`)
    bench      `dofattn bench`: prefill, decode and generation timed against softmax attention (`BenchConfig`)
    sample     `dofattn sample`: text from the teacher to train on (`SampleConfig`)
    export     `dofattn export`: a student written as a Hugging Face model folder (`ExportConfig`; the folder and
               its loading: `exported`)

`dofattn distill`'s job is the distillation stages' own (`distill.run`).
"""
