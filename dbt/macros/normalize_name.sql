{# The one definition of name normalization (lowercase, accents stripped, runs of
   non-alphanumerics to one space). medgraph.kg.graph applies the same SQL to queries. #}
{% macro normalize_name(expression) -%}
    trim(regexp_replace(lower(strip_accents({{ expression }})), '[^a-z0-9]+', ' ', 'g'))
{%- endmacro %}
