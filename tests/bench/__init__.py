def load_script(name: str):
    """``benchmarks/<name>.py`` imported as a module (the scripts are not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
