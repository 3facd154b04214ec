// A Java producer (Kafka 4.4.0's own client) that writes records read from a file, byte for byte:
// binary keys, values and header values, which kafka-console-producer's text lines cannot carry.
// Used by tests/support/foreign_producers.py; compiled there against the broker's classpath.
//
//   java -cp <classes>:<kafka lib>/* RecordFileProducer <bootstrap> <records file> [property=value ...]
//
// The file (big-endian): int count, then per record: UTF compression.type, UTF topic, bytes key,
// bytes value, int header count, per header: UTF key, bytes value; "bytes" is an int length (-1:
// null) and the bytes. One producer per compression type (the setting is a producer's); each sends
// its records and flushes once, so they share batches. Prints "partition offset" per record in
// file order; a failed send exits non-zero.

import java.io.BufferedInputStream;
import java.io.DataInputStream;
import java.io.FileInputStream;
import java.io.IOException;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.Future;

import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.header.internals.RecordHeaders;
import org.apache.kafka.common.serialization.ByteArraySerializer;

public final class RecordFileProducer {
    private static byte[] bytes(DataInputStream in) throws IOException {
        int length = in.readInt();
        if (length < 0) {
            return null;
        }
        byte[] out = new byte[length];
        in.readFully(out);
        return out;
    }

    public static void main(String[] args) throws Exception {
        Properties props = new Properties();
        props.put("bootstrap.servers", args[0]);
        props.put("acks", "all");
        props.put("linger.ms", "100");
        props.put("key.serializer", ByteArraySerializer.class.getName());
        props.put("value.serializer", ByteArraySerializer.class.getName());
        for (int i = 2; i < args.length; i++) {
            int eq = args[i].indexOf('=');
            props.put(args[i].substring(0, eq), args[i].substring(eq + 1));
        }
        List<Future<RecordMetadata>> sent = new ArrayList<>();
        Map<String, KafkaProducer<byte[], byte[]>> producers = new LinkedHashMap<>();
        try (DataInputStream in = new DataInputStream(new BufferedInputStream(new FileInputStream(args[1])))) {
            int count = in.readInt();
            for (int r = 0; r < count; r++) {
                String compression = in.readUTF();
                KafkaProducer<byte[], byte[]> producer = producers.computeIfAbsent(compression, c -> {
                    Properties own = new Properties();
                    own.putAll(props);
                    own.put("compression.type", c);
                    return new KafkaProducer<>(own);
                });
                String topic = in.readUTF();
                byte[] key = bytes(in);
                byte[] value = bytes(in);
                RecordHeaders headers = new RecordHeaders();
                int headerCount = in.readInt();
                for (int h = 0; h < headerCount; h++) {
                    headers.add(in.readUTF(), bytes(in));
                }
                sent.add(producer.send(new ProducerRecord<>(topic, null, null, key, value, headers)));
            }
            for (KafkaProducer<byte[], byte[]> producer : producers.values()) {
                producer.flush();
            }
            for (Future<RecordMetadata> future : sent) {
                RecordMetadata meta = future.get();
                System.out.println(meta.partition() + " " + meta.offset());
            }
        } finally {
            for (KafkaProducer<byte[], byte[]> producer : producers.values()) {
                producer.close();
            }
        }
    }
}
