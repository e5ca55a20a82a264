"""The kai-resource-isolator services and the CLI that composes them."""
