"""The model of a job: factories by import path (`factory`), the built-ins (`builtin`,
`decoder`), what a factory is told of the data (`inputs`), the model's parallel plans
(`plans`), the driver's checks (`check`), and the registered model that takes raw rows
(`registered`, `registered_code`, `files`: safetensors, never a pickle; `encoded_inputs`)."""
