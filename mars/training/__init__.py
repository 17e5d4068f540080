"""Training phase: base models of every profile, data preparation, the built-in suite, the trainer."""
