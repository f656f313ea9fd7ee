"""The swap: a Hugging Face model made a student and back, in one package.

    hf         loading a supported model (ten families), its attention modules, its local layers, dtypes, devices
    capture    the attention inputs of a forward (q, k, v after RoPE), for the DoF, the layerwise stage and eval
    attach     where a student's modules sit in an HF attention module (`linear_of`, `bounded_of`): the one lookup
    install    the "dofattn" attention implementation: a layer's `LinearAttention`, or softmax, and the cache binding
    bounded    a kept softmax layer's cache bounded after the prompt (`BoundedSoftmax`, its cache slots)
    prompt     reading long prompts in chunks (`PromptReader`)
    student    linearizing a model (`linearize`, `build`), saving and loading a student folder
    lora       LoRA adapters on the frozen projections
    exported   an export's classes (`from_pretrained`) and loading any student or export
    bundle     an export's own copy of the code it runs

Below it the layer (`attention`, `features`, `ops`, `spec`); above it the stages (`distill`) and the jobs.
"""
