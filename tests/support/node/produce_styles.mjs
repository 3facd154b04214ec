// Writes input events as a TypeScript producer does (issue 43), with kafkajs:
//   json:       @bufbuild/protobuf's toJson (the canonical JSON mapping), content-type application/json;
//   structured: the CloudEvents SDK's Kafka binding in structured mode (application/cloudevents+json),
//               the protobuf bytes as data_base64.
// Input on stdin: {"bootstrap": "...", "descriptors": base64 FileDescriptorSet, "records": [
//   {"style": "json"|"structured", "topic": "...", "key": "...", "type": "sandbox_lanes.v1.X",
//    "id": "...", "proto": base64 protobuf bytes}]}
// Prints one JSON line: {"written": N}.
import { createFileRegistry, fromBinary, toJsonString } from "@bufbuild/protobuf";
import { FileDescriptorSetSchema } from "@bufbuild/protobuf/wkt";
import { CloudEvent, Kafka as CEKafka } from "cloudevents";
import { Kafka, logLevel } from "kafkajs";

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const input = JSON.parse(Buffer.concat(chunks).toString("utf8"));
const registry = createFileRegistry(
  fromBinary(FileDescriptorSetSchema, Buffer.from(input.descriptors, "base64")),
);

function message(rec) {
  const bytes = Buffer.from(rec.proto, "base64");
  if (rec.style === "json") {
    const desc = registry.getMessage(rec.type);
    if (!desc) throw new Error(`no descriptor for ${rec.type}`);
    const value = toJsonString(desc, fromBinary(desc, bytes), { registry });
    return { key: rec.key, value, headers: { "content-type": "application/json" } };
  }
  if (rec.style === "structured") {
    const event = new CloudEvent({
      specversion: "1.0",
      type: rec.type,
      source: "node-producer",
      id: rec.id,
      datacontenttype: "application/protobuf",
      data: new Uint8Array(bytes),
      partitionkey: rec.key,
    });
    const out = CEKafka.structured(event);
    return { key: rec.key, value: out.body, headers: out.headers };
  }
  throw new Error(`unknown style ${rec.style}`);
}

const kafka = new Kafka({ clientId: "node-producer", brokers: [input.bootstrap], logLevel: logLevel.ERROR });
const producer = kafka.producer({ allowAutoTopicCreation: false });
await producer.connect();
let written = 0;
try {
  for (const rec of input.records) {
    // One send per record, in order: a workflow's create before its phase changes.
    await producer.send({ topic: rec.topic, acks: -1, messages: [message(rec)] });
    written += 1;
  }
} finally {
  await producer.disconnect();
}
console.log(JSON.stringify({ written }));
