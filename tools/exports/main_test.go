package main

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// The README's packages section promises a surface: interceptor at most
// 52 exported names, and the packages it lists at most 224 in all. A name added past either fails here, to be
// weighed, and the README's count updated.
func TestSurfaceKeepsTheREADMEsCount(t *testing.T) {
	root := filepath.Join("..", "..")
	limits := map[string]int{"interceptor": 52}
	total := 0
	for _, dir := range []string{".", "policy", "breaker", "interceptor", "overload", "mesh", "telemetry", "redisfleet"} {
		names, _, err := exported(filepath.Join(root, dir))
		if err != nil {
			t.Fatal(err)
		}
		if max, ok := limits[dir]; ok && len(names) > max {
			t.Errorf("%s exports %d names, the README promises at most %d: %v", dir, len(names), max, names)
		}
		total += len(names)
	}
	if total > 224 {
		t.Errorf("the packages export %d names in all, the README promises at most 224", total)
	}
}

func TestExported(t *testing.T) {
	dir := t.TempDir()
	src := `package p

type T struct{}
type u struct{}
type G[K comparable] struct{}

const A, b = 1, 2
var V int

func F()        {}
func f()        {}
func (T) M()    {}
func (*T) N()   {}
func (u) O()    {}
func (T) p()    {}
func (G[K]) Q() {}
`
	if err := os.WriteFile(filepath.Join(dir, "p.go"), []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "p_test.go"), []byte("package p\n\nfunc TestX() {}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	names, methods, err := exported(dir)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"A", "F", "G", "G.Q", "T", "T.M", "T.N", "V"}
	if !slices.Equal(names, want) || methods != 3 {
		t.Errorf("exported = %v, %d methods; want %v, 3", names, methods, want)
	}
	if _, _, err := exported(filepath.Join(dir, "none")); err == nil {
		t.Error("a directory without Go files: no error")
	}
}
