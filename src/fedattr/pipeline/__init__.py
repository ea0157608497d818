"""The composition root: a run's configuration (:mod:`.config`: the sections of every package,
presets) and building and running it (:mod:`.run`: data and model, client pool, round engine,
observers, results). The commands (``experiments``, ``flower``, ``owner``, the CLI) sit above it;
every package it assembles sits below it."""
