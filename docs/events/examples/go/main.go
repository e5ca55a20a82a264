// A durable JetStream consumer on isolator.health.> that validates every event against the published
// JSON Schema of its CloudEvents type and prints the verifier's verdicts. Stop it with Ctrl-C or SIGTERM.
//
//	NATS_URL    NATS server (default nats://127.0.0.1:4222)
//	DURABLE     consumer name; a restart resumes after the last acked event (default verdict-printer-go)
//	SCHEMA_DIR  the published schemas, docs/events/schemas (default ../../schemas)
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/santhosh-tekuri/jsonschema/v6"
)

const (
	stream  = "ISOLATOR"
	subject = "isolator.health.>"
)

var verdictType = regexp.MustCompile(`^io\.kai-isolator\.health\.verdict\.v\d+$`)

type cloudEvent struct {
	ID      string          `json:"id"`
	Type    string          `json:"type"`
	Subject string          `json:"subject"`
	Data    json.RawMessage `json:"data"`
}

type healthVerdict struct {
	Pod struct {
		Namespace string `json:"namespace"`
		Name      string `json:"name"`
	} `json:"pod"`
	Container string `json:"container"`
	Verdict   string `json:"verdict"`
	Reasons   []struct {
		Code string `json:"code"`
	} `json:"reasons"`
}

func env(name, fallback string) string {
	if value := os.Getenv(name); value != "" {
		return value
	}
	return fallback
}

// loadSchemas compiles one validator per event type, keyed by the schema's file name (`<type>.json`).
func loadSchemas(dir string) (map[string]*jsonschema.Schema, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil || len(files) == 0 {
		return nil, fmt.Errorf("no schemas in %s", dir)
	}
	compiler := jsonschema.NewCompiler()
	compiler.AssertFormat()
	schemas := make(map[string]*jsonschema.Schema, len(files))
	for _, file := range files {
		absolute, err := filepath.Abs(file)
		if err != nil {
			return nil, err
		}
		schema, err := compiler.Compile(absolute)
		if err != nil {
			return nil, fmt.Errorf("schema %s: %w", file, err)
		}
		schemas[strings.TrimSuffix(filepath.Base(file), ".json")] = schema
	}
	return schemas, nil
}

func oneLine(err error) string {
	return strings.Join(strings.Fields(strings.ReplaceAll(err.Error(), "\n", "; ")), " ")
}

func handle(msg jetstream.Msg, schemas map[string]*jsonschema.Schema) {
	seq := uint64(0)
	if meta, err := msg.Metadata(); err == nil {
		seq = meta.Sequence.Stream
	}
	instance, err := jsonschema.UnmarshalJSON(bytes.NewReader(msg.Data()))
	var event cloudEvent
	if err == nil {
		err = json.Unmarshal(msg.Data(), &event)
	}
	if err != nil {
		fmt.Printf("invalid seq=%d subject=%s: not JSON (%s)\n", seq, msg.Subject(), oneLine(err))
		_ = msg.Term()
		return
	}
	schema, known := schemas[event.Type]
	if !known {
		// A type newer than our schemas: the contract only ever adds types, so skip it rather than fail.
		fmt.Printf("skipped seq=%d subject=%s: no published schema for type %q\n", seq, msg.Subject(), event.Type)
		_ = msg.Ack()
		return
	}
	if err := schema.Validate(instance); err != nil {
		fmt.Printf("invalid seq=%d subject=%s type=%s: %s\n", seq, msg.Subject(), event.Type, oneLine(err))
		_ = msg.Term() // redelivering a message that does not match its schema would not make it match
		return
	}
	if verdictType.MatchString(event.Type) {
		var v healthVerdict
		if err := json.Unmarshal(event.Data, &v); err != nil {
			fmt.Printf("invalid seq=%d subject=%s type=%s: %s\n", seq, msg.Subject(), event.Type, oneLine(err))
			_ = msg.Term()
			return
		}
		codes := make([]string, 0, len(v.Reasons))
		for _, r := range v.Reasons {
			codes = append(codes, r.Code)
		}
		reasons := strings.Join(codes, ",")
		if reasons == "" {
			reasons = "-"
		}
		fmt.Printf("valid id=%s type=%s pod=%s/%s container=%s verdict=%s reasons=%s\n",
			event.ID, event.Type, v.Pod.Namespace, v.Pod.Name, v.Container, v.Verdict, reasons)
	} else {
		fmt.Printf("valid id=%s type=%s subject=%s\n", event.ID, event.Type, event.Subject)
	}
	_ = msg.Ack()
}

func run() error {
	url := env("NATS_URL", "nats://127.0.0.1:4222")
	durable := env("DURABLE", "verdict-printer-go")
	schemaDir := env("SCHEMA_DIR", filepath.Join("..", "..", "schemas"))

	schemas, err := loadSchemas(schemaDir)
	if err != nil {
		return err
	}
	nc, err := nats.Connect(url, nats.Name(durable), nats.MaxReconnects(-1))
	if err != nil {
		return fmt.Errorf("cannot connect to NATS at %s: %w", url, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// Creating a durable that already exists with this configuration just binds to it.
	consumer, err := js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{
		Durable:       durable,
		FilterSubject: subject,
		AckPolicy:     jetstream.AckExplicitPolicy,
		DeliverPolicy: jetstream.DeliverAllPolicy,
	})
	if err != nil {
		return fmt.Errorf("cannot create consumer %s on stream %s (is the isolator running?): %w", durable, stream, err)
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	consuming, err := consumer.Consume(func(msg jetstream.Msg) { handle(msg, schemas) })
	if err != nil {
		return err
	}
	fmt.Printf("ready: durable %s on stream %s, filter %s, %d schemas from %s\n", durable, stream, subject, len(schemas), schemaDir)
	<-stop
	consuming.Drain()
	<-consuming.Closed()
	if err := nc.Drain(); err != nil {
		return err
	}
	fmt.Println("stopped")
	return nil
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "verdict subscriber: %s\n", err)
		os.Exit(1)
	}
}
