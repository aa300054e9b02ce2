"""What a request meets first, holding no engine: the HTTP rules (key, CORS, body limit, trace), the error
JSON, the health report, the ingress deployment and the relay to the replicas."""
