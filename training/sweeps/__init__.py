"""Hyperparameter sweeps: the driver's loop (`run`), its settings (`config`), Optuna's
side (`study`) and what a sweep leaves behind (`report`)."""
