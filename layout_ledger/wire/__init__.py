"""The wire: the protocol's shapes and the service that turns a request into a transition."""
