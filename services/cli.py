"""Command-line entry point `kai-isolator`: composes the services; placeholder."""


def main() -> None:
    print("kai-isolator")
