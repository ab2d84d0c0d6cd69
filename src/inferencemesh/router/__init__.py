"""The router: one endpoint in front of N replicas' frontends, each request sent to the replica
most likely to hold its prompt's prefix in its prefix cache (policy), replicas from a static list
or a Service's EndpointSlices (replicas), requests relayed unbuffered (app). A library layer: it
imports only bottom modules and never torch, so that it runs in a small pod."""
