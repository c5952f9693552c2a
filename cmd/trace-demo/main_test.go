package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestMissingJaegerSaysHowToBuildIt(t *testing.T) {
	var out bytes.Buffer
	o := options{bin: t.TempDir(), config: "../../tools/jaeger/config.yaml", stdout: &out, stderr: &out}
	err := run(context.Background(), o)
	if err == nil || !strings.Contains(err.Error(), "make jaeger") {
		t.Errorf("run without a jaeger binary = %v, want an error saying `make jaeger` builds it", err)
	}
}

func TestPrefixedWriter(t *testing.T) {
	var b bytes.Buffer
	w := prefixed(&b, "jaeger: ")
	for _, s := range []string{"one\ntw", "o\n", "three"} {
		if _, err := w.Write([]byte(s)); err != nil {
			t.Fatal(err)
		}
	}
	if want := "jaeger: one\njaeger: two\njaeger: three"; b.String() != want {
		t.Errorf("got %q, want %q", b.String(), want)
	}
}
