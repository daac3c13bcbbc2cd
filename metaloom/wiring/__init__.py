"""The edge where names meet objects: what the CLI, the server and `metaloom eval` share to
turn text (a strategy spec, a backend's settings) into library objects. Library code never
imports it; it imports every layer below it."""
