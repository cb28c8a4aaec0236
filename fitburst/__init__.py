"""fitburst: declarative LoRA/QLoRA fine-tuning that knows whether a run fits before it starts."""

__version__ = "0.1.0"
