"""The ground every stage stands on: what prepare, training, scoring and the CLI all use.

Errors a user sees as one line (`errors`, `redact`), how the library talks to its user
(`report`, `progress`), state as URLs on any store and its commits (`storage`,
`object_stores`, `failures`, `lease`), the code that travels with a job (`code_travel`,
`zips`, `environ`), the engines' config sections and sessions (`engine_config`,
`sessions`, `spark_setup`, `spark_probe`, `spark_user_conf`) and the config base
(`section`). Nothing here imports a stage: `pipelines`, `training`, `serving` and `jobs`
import it, never the reverse.
"""
