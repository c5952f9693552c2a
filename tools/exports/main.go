// Command exports counts the exported identifiers of package directories:
// top-level consts, vars, types and funcs, and methods on exported types,
// test files left out. make exports prints the counts the README's
// packages section gives.
//
//	go run ./tools/exports [-list] dir...
package main

import (
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"log"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

func main() {
	list := flag.Bool("list", false, "print each package's exported names too")
	flag.Parse()
	total := 0
	for _, dir := range flag.Args() {
		names, methods, err := exported(dir)
		if err != nil {
			log.Fatal(err)
		}
		if *list {
			fmt.Println(strings.Join(names, " "))
		}
		fmt.Printf("%-16s %4d top-level, %4d methods, %4d in all\n", dir, len(names)-methods, methods, len(names))
		total += len(names)
	}
	fmt.Printf("%-16s %4d\n", "total", total)
}

// exported returns the exported names of the package in dir, sorted
// (methods as Type.Method), and how many of them are methods.
func exported(dir string) (names []string, methods int, err error) {
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		return nil, 0, err
	}
	fset := token.NewFileSet()
	for _, path := range files {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return nil, 0, err
		}
		for _, d := range f.Decls {
			switch d := d.(type) {
			case *ast.FuncDecl:
				if !d.Name.IsExported() {
					continue
				}
				if d.Recv == nil {
					names = append(names, d.Name.Name)
				} else if recv := receiver(d.Recv.List[0].Type); ast.IsExported(recv) {
					names = append(names, recv+"."+d.Name.Name)
					methods++
				}
			case *ast.GenDecl:
				for _, s := range d.Specs {
					switch s := s.(type) {
					case *ast.TypeSpec:
						if s.Name.IsExported() {
							names = append(names, s.Name.Name)
						}
					case *ast.ValueSpec:
						for _, n := range s.Names {
							if n.IsExported() {
								names = append(names, n.Name)
							}
						}
					}
				}
			}
		}
	}
	if len(files) == 0 {
		return nil, 0, fmt.Errorf("exports: %s: no Go files", dir)
	}
	slices.Sort(names)
	return names, methods, nil
}

// receiver is the name of a method's receiver type.
func receiver(t ast.Expr) string {
	for {
		switch e := t.(type) {
		case *ast.StarExpr:
			t = e.X
		case *ast.IndexExpr:
			t = e.X
		case *ast.IndexListExpr:
			t = e.X
		case *ast.Ident:
			return e.Name
		default:
			return ""
		}
	}
}

func init() { log.SetFlags(0); flag.CommandLine.SetOutput(os.Stderr) }
