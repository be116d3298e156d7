// Command stripstubs removes from protoc-gen-go-grpc output the server stubs
// csibroker never uses: the Unimplemented<Service>Server types (whose methods
// answer codes.Unimplemented) and the Unsafe<Service>Server interfaces. Every
// server of this repository implements its whole service, and the services
// are ours, so no forward-compatibility stub is needed. `make proto` runs it
// on every *_grpc.pb.go after protoc.
package main

import (
	"bytes"
	"fmt"
	"go/ast"
	"go/format"
	"go/parser"
	"go/token"
	"os"
	"regexp"
	"strings"
)

var (
	stubType = regexp.MustCompile(`^(Unimplemented|Unsafe)\w+Server$`)
	embedDoc = regexp.MustCompile(`// All implementations should embed Unimplemented\w+Server\n// for forward compatibility\.\n`)
	panicDoc = regexp.MustCompile(`\t// If the following call panics[^\n]*\n(\t//[^\n]*\n)*\n*`)
)

func main() {
	for _, path := range os.Args[1:] {
		if err := strip(path); err != nil {
			fmt.Fprintf(os.Stderr, "stripstubs: %s: %v\n", path, err)
			os.Exit(1)
		}
	}
}

func strip(path string) error {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, path, nil, parser.ParseComments)
	if err != nil {
		return err
	}
	var keep []ast.Decl
	for _, d := range f.Decls {
		switch d := d.(type) {
		case *ast.GenDecl:
			if d.Tok == token.TYPE && len(d.Specs) == 1 && stubType.MatchString(d.Specs[0].(*ast.TypeSpec).Name.Name) {
				continue
			}
		case *ast.FuncDecl:
			if d.Recv != nil && len(d.Recv.List) == 1 {
				if id, ok := d.Recv.List[0].Type.(*ast.Ident); ok && stubType.MatchString(id.Name) {
					continue
				}
			}
			if strings.HasPrefix(d.Name.Name, "Register") && d.Body != nil {
				// Drop the check that a stub is embedded by value.
				var body []ast.Stmt
				for _, st := range d.Body.List {
					if _, ok := st.(*ast.IfStmt); !ok {
						body = append(body, st)
					}
				}
				d.Body.List = body
			}
		}
		keep = append(keep, d)
	}
	f.Decls = keep
	// Drop the imports only the stubs used.
	used := map[string]bool{}
	ast.Inspect(f, func(n ast.Node) bool {
		if s, ok := n.(*ast.SelectorExpr); ok {
			if id, ok := s.X.(*ast.Ident); ok {
				used[id.Name] = true
			}
		}
		return true
	})
	for _, name := range []string{"codes", "status"} {
		if !used[name] {
			deleteImport(f, "google.golang.org/grpc/"+name)
		}
	}
	// Comments of removed declarations would otherwise be printed loose.
	var comments []*ast.CommentGroup
	for _, cg := range f.Comments {
		if inDecls(f, cg) {
			comments = append(comments, cg)
		}
	}
	f.Comments = comments
	var buf bytes.Buffer
	if err := format.Node(&buf, fset, f); err != nil {
		return err
	}
	// The server interface's doc asks implementations to embed the stub.
	// RegisterXServer's comment explains the check dropped above.
	out, err := format.Source(panicDoc.ReplaceAll(embedDoc.ReplaceAll(buf.Bytes(), nil), nil))
	if err != nil {
		return err
	}
	return os.WriteFile(path, out, 0o644)
}

// inDecls: cg is the file's doc, a package-level comment before the first
// declaration, or lies within a kept declaration (or its doc).
func inDecls(f *ast.File, cg *ast.CommentGroup) bool {
	if len(f.Decls) == 0 || cg.End() <= f.Decls[0].Pos() {
		return true
	}
	for _, d := range f.Decls {
		start := d.Pos()
		switch d := d.(type) {
		case *ast.GenDecl:
			if d.Doc != nil {
				start = d.Doc.Pos()
			}
		case *ast.FuncDecl:
			if d.Doc != nil {
				start = d.Doc.Pos()
			}
		}
		if cg.Pos() >= start && cg.End() <= d.End() {
			return true
		}
	}
	return false
}

func deleteImport(f *ast.File, path string) {
	for _, d := range f.Decls {
		g, ok := d.(*ast.GenDecl)
		if !ok || g.Tok != token.IMPORT {
			continue
		}
		var specs []ast.Spec
		for _, s := range g.Specs {
			if s.(*ast.ImportSpec).Path.Value != `"`+path+`"` {
				specs = append(specs, s)
			}
		}
		g.Specs = specs
	}
	var imps []*ast.ImportSpec
	for _, s := range f.Imports {
		if s.Path.Value != `"`+path+`"` {
			imps = append(imps, s)
		}
	}
	f.Imports = imps
}
