"""Prefect tasks, one module per DAG node; each calls one fitburst function and adds logging and artifacts."""


def artifact_key(name: str) -> str:
    """A Prefect artifact key from a pipeline name (keys allow lowercase letters, digits and dashes)."""
    return "".join(c if c.isalnum() else "-" for c in name.lower())
