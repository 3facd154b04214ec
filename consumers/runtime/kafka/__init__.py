"""The pod's Kafka edge: clients, the transactional producers and sinks, topics, security, and
which failures are the record's and which the world's."""
