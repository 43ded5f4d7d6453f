//! Derive macros of the Transformer Engine for Rust.
//!
//! `#[derive(Module)]` implements `te_nn::modules::Module` for a model struct: one
//! path-keyed traversal of its parameters and FP8 scaling states that checkpoints, parameter
//! counts, optimizers and `zero_grad` are built on, and the list of kernels the model runs (for
//! `te prewarm`). Use it through `te_nn::Module`, which
//! re-exports both the trait and this derive.

use proc_macro::TokenStream;
use proc_macro2::TokenStream as TokenStream2;
use quote::{quote, quote_spanned};
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::{parse_macro_input, Attribute, Data, DeriveInput, Error, Index, Member};

/// Implements `te_nn::modules::Module` for a struct whose fields are modules (TE layers,
/// other derived structs, `Vec`s, `Option`s, arrays and `Box`es of them).
///
/// Each field is visited in declaration order under its name (`prefix.field`; a tuple struct's
/// fields under their index); `#[module(skip)]` leaves out a field that holds no parameters
/// (a config, a count, a name). `kernel_specs` adds the kernels of every visited field. Generic structs get a `Field: Module` bound per visited field.
/// Enums and unions are refused at compile time.
#[proc_macro_derive(Module, attributes(module))]
pub fn derive_module(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand(&input).unwrap_or_else(Error::into_compile_error).into()
}

/// The impl, or the first misuse as an error spanning it.
fn expand(input: &DeriveInput) -> syn::Result<TokenStream2> {
    if let Some(attr) = input.attrs.iter().find(|a| a.path().is_ident("module")) {
        return Err(Error::new_spanned(attr, "`#[module(...)]` goes on fields: `#[module(skip)]`"));
    }
    let fields = match &input.data {
        Data::Struct(s) => &s.fields,
        Data::Enum(e) => return Err(Error::new_spanned(e.enum_token, not_a_struct("an enum"))),
        Data::Union(u) => return Err(Error::new_spanned(u.union_token, not_a_struct("a union"))),
    };
    // (how the field is reached, its path segment, its type) for each visited field.
    let mut visited = Vec::new();
    for (i, field) in fields.iter().enumerate() {
        if is_skipped(&field.attrs)? {
            continue;
        }
        let (member, name) = match &field.ident {
            Some(ident) => (Member::Named(ident.clone()), ident.unraw().to_string()),
            None => (Member::Unnamed(Index::from(i)), i.to_string()),
        };
        visited.push((member, name, &field.ty));
    }

    let krate = quote!(::te_nn::modules);
    let mut generics = input.generics.clone();
    if !generics.params.is_empty() {
        let clause = generics.make_where_clause();
        for (_, _, ty) in &visited {
            clause.predicates.push(syn::parse_quote!(#ty: #krate::Module));
        }
    }
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    let ident = &input.ident;
    let unused = visited.is_empty().then(|| quote!(let _ = (prefix, visitor);));
    let unused_specs = visited.is_empty().then(|| quote!(let _ = (target, specs);));
    // Spanned at the field's type, so a field that is not a Module is reported there.
    let visit = visited.iter().map(|(member, name, ty)| {
        quote_spanned! {ty.span()=>
            ::te_nn::modules::Module::visit(
                &self.#member, &::te_nn::modules::join_path(prefix, #name), visitor)?;
        }
    });
    let visit_mut = visited.iter().map(|(member, name, ty)| {
        quote_spanned! {ty.span()=>
            ::te_nn::modules::Module::visit_mut(
                &mut self.#member, &::te_nn::modules::join_path(prefix, #name), visitor)?;
        }
    });
    let kernel_specs = visited.iter().map(|(member, _, ty)| {
        quote_spanned! {ty.span()=>
            ::te_nn::modules::Module::kernel_specs(&self.#member, target, specs);
        }
    });
    Ok(quote! {
        #[automatically_derived]
        impl #impl_generics #krate::Module for #ident #ty_generics #where_clause {
            fn visit(
                &self,
                prefix: &::core::primitive::str,
                visitor: &mut dyn #krate::ModuleVisitor,
            ) -> ::te_nn::Result<()> {
                #unused
                #(#visit)*
                ::core::result::Result::Ok(())
            }

            fn visit_mut(
                &mut self,
                prefix: &::core::primitive::str,
                visitor: &mut dyn #krate::ModuleVisitorMut,
            ) -> ::te_nn::Result<()> {
                #unused
                #(#visit_mut)*
                ::core::result::Result::Ok(())
            }

            fn kernel_specs(
                &self,
                target: &#krate::KernelTarget,
                specs: &mut ::std::vec::Vec<#krate::KernelSpec>,
            ) {
                #unused_specs
                #(#kernel_specs)*
            }
        }
    })
}

/// The error for a non-struct input.
fn not_a_struct(what: &str) -> String {
    format!(
        "derive(Module) supports structs with named or tuple fields, not {what}: a model's parameters must be \
         the same whatever its value; put the modules in struct fields (`Option<T>` for one that may be absent)"
    )
}

/// Whether a field carries `#[module(skip)]`; an error for any other `#[module(...)]` argument.
fn is_skipped(attrs: &[Attribute]) -> syn::Result<bool> {
    let mut skip = false;
    for attr in attrs.iter().filter(|a| a.path().is_ident("module")) {
        attr.parse_nested_meta(|meta| {
            if !meta.path.is_ident("skip") {
                return Err(meta.error("unknown `module` argument; the one argument is `skip`: `#[module(skip)]`"));
            }
            if skip {
                return Err(meta.error("`skip` given twice"));
            }
            skip = true;
            Ok(())
        })?;
    }
    Ok(skip)
}
