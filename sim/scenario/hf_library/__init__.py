"""The bundled model library: published ``config.json`` files and ``index.json`` (name -> hub id,
family, where the config was read, file). Data only; ``sim.scenario.hf_model`` reads it."""
