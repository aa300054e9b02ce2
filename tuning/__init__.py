"""Tuning: a Ray Tune + Optuna study over llama.cpp settings, measured on serving's own engine."""
